"""Your own model and dataset: registered beside fedge's built-in ones, and checked before any run uses them.

A plugin registers a **model factory** ``factory(input_shape, num_classes) -> nn.Module`` (its ``forward(x)`` returns
logits ``(N, num_classes)``) and a **dataset loader** ``loader(data_dir, seed) -> DatasetArrays`` (train and test
arrays and the number of classes; ``data_dir`` is the run's ``--data-dir``, ``None`` when not given). Three ways in:

- an installed package declares entry points: group ``fedge.models`` (name = model name, object = its factory)
and
  group ``fedge.datasets`` (name = dataset name, object = its loader or a :class:`DatasetPlugin`);
- ``FEDGE_PLUGINS``: modules (``my_pkg.fedge_plugin``) or Python files (``./plugin.py``), separated by commas, whose
  import calls :func:`register_model` / :func:`register_dataset`;
- ``--plugin MODULE_OR_FILE`` on ``fedge sim``, ``provision``, ``coordinator``, ``client``, ``export`` and ``cost``:
  added to ``FEDGE_PLUGINS`` so that the processes fedge starts (clients, workers) import it too.

Plugins load once, at the first lookup of a model or dataset name. A name that is a built-in or that two plugins
claim is a :class:`PluginError`; whatever a loader returns is checked (types, shapes, dtypes, finite values, label
range) and becomes :class:`fedge.data.datasets.Dataset` splits, so the rest of fedge never sees unchecked arrays.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from torch import nn

from fedge.errors import ConfigError, DatasetError

__all__ = [
    "ENV",
    "DatasetArrays",
    "DatasetPlugin",
    "PluginError",
    "load_class_folders",
    "load_plugins",
    "plugin_dataset_arrays",
    "plugin_dataset_names",
    "plugin_model",
    "plugin_model_names",
    "register_dataset",
    "register_model",
    "reserve_builtin_names",
]

log = logging.getLogger(__name__)

ENV = "FEDGE_PLUGINS"
"""Environment variable: plugin modules or ``.py`` files, comma-separated, imported at the first registry lookup."""

MODEL_GROUP = "fedge.models"
DATASET_GROUP = "fedge.datasets"

ModelFactory: TypeAlias = Callable[[tuple[int, ...], int], nn.Module]
"""``factory(input_shape, num_classes)``: a fresh model whose ``forward(x)`` returns ``(N, num_classes)`` logits."""


class PluginError(ConfigError):
    """A plugin cannot be imported, claims a taken name, or returned something fedge cannot use."""


@dataclass(frozen=True)
class DatasetArrays:
    """What a dataset loader returns: numpy arrays of the train and test splits and the number of classes.

    ``x_*``: float inputs ``(N, *input_shape)`` (made float32; normalize them yourself) or integer token ids
    ``(N, L)`` (made int64); ``y_*``: integer labels ``(N,)`` in ``[0, num_classes)``. Checked by fedge, not here.
    """

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    num_classes: int


@dataclass(frozen=True)
class DatasetPlugin:
    """A registered dataset: its loader and the model a run uses when it names none (``None``: ``--model`` needed)."""

    loader: Callable[[Path | None, int], DatasetArrays]
    default_model: str | None = None


_models: dict[str, ModelFactory] = {}
_datasets: dict[str, DatasetPlugin] = {}
_origin: dict[str, str] = {}  # "model:NAME" / "dataset:NAME" -> the plugin that registered it (for error messages)
_imported: set[str] = set()  # FEDGE_PLUGINS entries already imported
_entry_points_loaded = False
_current = "your code"  # the plugin being imported, for messages


_builtin: dict[str, set[str]] = {"model": set(), "dataset": set()}  # fedge's own names, which plugins cannot take


def reserve_builtin_names(kind: str, names: Iterable[str]) -> None:
    """Called by :mod:`fedge.learning.models` and :mod:`fedge.data.datasets` as they load: their names are fedge's.
    A plugin registered earlier under one of them is refused now."""
    names = set(names)
    taken = _models if kind == "model" else _datasets
    clash = sorted(names & set(taken))
    if clash:
        raise PluginError(
            f"{_origin[f'{kind}:{clash[0]}']}: {kind} {clash[0]!r} collides with fedge's built-in {kind} of that name; "
            "give yours another name"
        )
    _builtin[kind] |= names


def _claim(kind: str, name: str, builtins: set[str], taken: dict[str, Any], value: Any) -> bool:
    """True when ``name`` is free to register; False when the same object is registered again (an import repeated)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise PluginError(f"{_current}: {kind} name {name!r} must be an identifier (letters, digits, underscores)")
    if name in builtins:
        raise PluginError(
            f"{_current}: {kind} {name!r} collides with fedge's built-in {kind} of that name; give yours another name"
        )
    if name in taken:
        if taken[name] == value:
            return False
        raise PluginError(
            f"{_current}: {kind} {name!r} is already registered by {_origin[f'{kind}:{name}']}; "
            "two plugins cannot share a name"
        )
    return True


def register_model(name: str, factory: ModelFactory) -> None:
    """Make ``name`` a model for ``--model`` and client data files; ``factory(input_shape, num_classes)``."""
    if not callable(factory):
        raise PluginError(f"{_current}: model {name!r}: the factory must be callable, got {type(factory).__name__}")
    if _claim("model", name, _builtin["model"], _models, factory):
        _models[name] = factory
        _origin[f"model:{name}"] = _current


def register_dataset(
    name: str, loader: Callable[[Path | None, int], DatasetArrays], *, default_model: str | None = None
) -> None:
    """Make ``name`` a dataset for ``--dataset``; ``loader(data_dir, seed)`` returns :class:`DatasetArrays`."""
    if not callable(loader):
        raise PluginError(f"{_current}: dataset {name!r}: the loader must be callable, got {type(loader).__name__}")
    plugin = DatasetPlugin(loader, default_model)
    if _claim("dataset", name, _builtin["dataset"], _datasets, plugin):
        _datasets[name] = plugin
        _origin[f"dataset:{name}"] = _current


# --------------------------------------------------------------------------------------------------------- loading


def plugin_entries(text: str | None) -> list[str]:
    """The entries of a ``FEDGE_PLUGINS`` value, in order, without blanks."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _import_entry(entry: str) -> None:
    global _current
    previous, _current = _current, f"plugin {entry}"
    try:
        if entry.endswith(".py") or os.sep in entry:
            path = Path(entry)
            if not path.is_file():
                raise PluginError(f"plugin file {path} does not exist (from --plugin or {ENV})")
            # A stable module name per file (its stem and a digest of its resolved path: two plugin.py files in two
            # folders stay two modules), so that pickled references (process workers) resolve the same module.
            digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
            module_name = f"fedge_plugin_{path.stem}_{digest}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise PluginError(f"plugin file {path} cannot be imported as Python")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        else:
            importlib.import_module(entry)
    except PluginError:
        raise
    except ImportError as exc:
        raise PluginError(f"plugin {entry!r} cannot be imported: {exc}") from exc
    except Exception as exc:  # a plugin's own bug: one line that names it, not a traceback from fedge
        raise PluginError(f"plugin {entry!r} failed while importing: {type(exc).__name__}: {exc}") from exc
    finally:
        _current = previous


def _load_entry_points() -> None:
    global _entry_points_loaded, _current
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for group in (MODEL_GROUP, DATASET_GROUP):
        for ep in entry_points(group=group):
            previous, _current = _current, f"entry point {ep.name} = {ep.value} ({group})"
            try:
                try:
                    obj = ep.load()
                except Exception as exc:
                    raise PluginError(f"{_current} cannot be loaded: {type(exc).__name__}: {exc}") from exc
                if group == MODEL_GROUP:
                    register_model(ep.name, obj)
                elif isinstance(obj, DatasetPlugin):
                    register_dataset(ep.name, obj.loader, default_model=obj.default_model)
                else:
                    register_dataset(ep.name, obj)
            finally:
                _current = previous


def load_plugins(extra: Sequence[str] = ()) -> None:
    """Import the installed entry points, ``FEDGE_PLUGINS``'s entries and ``extra`` (each once, in that order)."""
    _load_entry_points()
    for entry in [*plugin_entries(os.environ.get(ENV)), *extra]:
        key = str(Path(entry).resolve()) if entry.endswith(".py") or os.sep in entry else entry
        if key not in _imported:
            _import_entry(entry)
            _imported.add(key)


def plugin_model_names() -> list[str]:
    load_plugins()
    return sorted(_models)


def plugin_dataset_names() -> list[str]:
    load_plugins()
    return sorted(_datasets)


def plugin_model(name: str) -> ModelFactory | None:
    """The factory a plugin registered as ``name``, checked on each call; None when no plugin has that name."""
    load_plugins()
    factory = _models.get(name)
    if factory is None:
        return None

    def checked(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        try:
            model = factory(input_shape, num_classes)
        except Exception as exc:
            raise PluginError(
                f"model {name!r} ({_origin[f'model:{name}']}) failed to build for input shape {input_shape} and "
                f"{num_classes} classes: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(model, nn.Module):
            raise PluginError(f"model {name!r}: the factory returned {type(model).__name__}, not a torch nn.Module")
        if not any(v.is_floating_point() for v in model.state_dict().values()):
            raise PluginError(f"model {name!r} has no floating-point parameters: there is nothing to train or exchange")
        if not hasattr(model, "input_shape"):  # what fedge.learning.models.example_input and the exporters read
            vars(model)["input_shape"] = tuple(input_shape)  # a plain attribute (nn.Module keeps those in __dict__)
        return model

    return checked


def check_model_on(name: str, model: nn.Module, x: np.ndarray, num_classes: int) -> None:
    """PluginError unless ``model`` maps the samples ``x`` to finite ``(len(x), num_classes)`` logits (in eval mode,
    without gradients: a dry run before any client trains it)."""
    import torch

    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.from_numpy(x))
    except Exception as exc:
        raise PluginError(
            f"model {name!r} cannot take the dataset's inputs ({x.dtype} {tuple(x.shape[1:])} per sample): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(x), num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise PluginError(
            f"model {name!r} must return logits of shape (N, {num_classes}) for N samples; "
            f"for {len(x)} it returned {got}"
        )
    if not out.is_floating_point() or not bool(torch.isfinite(out).all()):
        raise PluginError(f"model {name!r} returned {out.dtype} logits that are not all finite")


def plugin_default_model(dataset: str) -> str | None:
    """The default model a plugin dataset was registered with (None: no such dataset or no default)."""
    load_plugins()
    plugin = _datasets.get(dataset)
    return plugin.default_model if plugin is not None else None


def plugin_dataset_arrays(name: str, data_dir: str | Path | None, seed: int) -> DatasetArrays | None:
    """What the loader of the plugin dataset ``name`` returned (checked by :func:`fedge.data.datasets.checked_splits`);
    None when no plugin has that name."""
    load_plugins()
    plugin = _datasets.get(name)
    if plugin is None:
        return None
    try:
        arrays = plugin.loader(Path(data_dir) if data_dir is not None else None, seed)
    except (DatasetError, ConfigError):
        raise
    except Exception as exc:
        raise PluginError(
            f"dataset {name!r} ({_origin[f'dataset:{name}']}) failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    return arrays


# ------------------------------------------------------------------------------------------- a directory of files


_MAX_FOLDER_FILES = 1_000_000  # a guard against pointing --data-dir at the wrong tree


def load_class_folders(directory: Path | None) -> DatasetArrays:
    """A dataset stored as one ``.npy`` file per sample: ``DIR/train/<class>/*.npy`` and ``DIR/test/<class>/*.npy``.

    Classes are the sorted folder names of ``train/`` (label 0 for the first); ``test/`` may lack some of them but
    has no others. Every file holds one sample's array (all of one shape), read without pickle.
    """
    if directory is None:
        raise DatasetError("this dataset is a directory of files: pass --data-dir DIR holding train/ and test/")
    directory = Path(directory)
    train_dir, test_dir = directory / "train", directory / "test"
    for folder in (train_dir, test_dir):
        if not folder.is_dir():
            raise DatasetError(f"missing folder {folder}; expected {directory}/{{train,test}}/<class>/<sample>.npy")
    classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise DatasetError(f"{train_dir} must hold one folder per class (at least 2), found {classes}")
    unknown = sorted(p.name for p in test_dir.iterdir() if p.is_dir() and p.name not in classes)
    if unknown:
        raise DatasetError(f"{test_dir} has class folders {unknown} that {train_dir} lacks")
    x_train, y_train = _read_folders(train_dir, classes)
    x_test, y_test = _read_folders(test_dir, classes)
    return DatasetArrays(x_train, y_train, x_test, y_test, num_classes=len(classes))


def _read_folders(root: Path, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    samples: list[np.ndarray] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        folder = root / cls
        files = sorted(folder.glob("*.npy")) if folder.is_dir() else []
        if len(samples) + len(files) > _MAX_FOLDER_FILES:
            raise DatasetError(f"{root} holds more than {_MAX_FOLDER_FILES:,} samples; is --data-dir right?")
        for path in files:
            try:
                sample = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise DatasetError(f"cannot read {path} as a numpy .npy array: {exc}") from None
            if samples and sample.shape != samples[0].shape:
                raise DatasetError(f"{path} has shape {sample.shape}, the samples before it {samples[0].shape}")
            samples.append(sample)
            labels.append(label)
    if not samples:
        raise DatasetError(f"no .npy samples in {root}/<class>/")
    return np.stack(samples), np.asarray(labels, dtype=np.int64)  # values are checked with every loader's output
