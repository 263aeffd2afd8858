"""In-memory datasets: MNIST-style IDX files, CIFAR-10 binary batches, scikit-learn digits and a synthetic task.

Every loader returns a ``(train, test)`` pair of :class:`Dataset` values whose inputs are already normalized, so
models and partitioners never see raw pixels. Loaders read only local files (nothing is downloaded) and turn every
missing or malformed file into a :class:`~fedge.errors.DatasetError` that names the file, what is wrong and the
directory layout that was expected.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge import plugins
from fedge.data.cache import cached_splits
from fedge.errors import ConfigError, DatasetError
from fedge.plugins import DatasetArrays, PluginError

__all__ = [
    "DATASETS",
    "Dataset",
    "load_cifar10",
    "load_dataset",
    "load_digits_dataset",
    "load_fashion_mnist",
    "load_idx_dir",
    "load_mnist",
    "make_synthetic",
]

DATASETS: tuple[str, ...] = ("digits", "synthetic", "mnist", "fashion_mnist", "cifar10")
"""Names :func:`load_dataset` accepts."""

# Per-dataset (mean, std) of training pixels scaled to [0, 1]; the values every MNIST/Fashion-MNIST baseline uses.
_IDX_NORMALIZATION: dict[str, tuple[float, float]] = {
    "mnist": (0.1307, 0.3081),
    "fashion_mnist": (0.2860, 0.3530),
}

_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049
_IDX_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

# Per-channel statistics of the CIFAR-10 training set. The std is the true per-pixel one; the often-copied
# (0.2023, 0.1994, 0.2010) is the mean of per-image stds and under-scales the inputs.
_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)
_CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR_TEST_FILE = "test_batch.bin"
_CIFAR_SIDE = 32
_CIFAR_RECORD = 1 + 3 * _CIFAR_SIDE * _CIFAR_SIDE  # label byte + R, G, B planes
_CIFAR_CLASSES = 10
# The official tarball unpacks into this folder; accept its parent too.
_CIFAR_SUBDIR = "cifar-10-batches-bin"

_SYNTHETIC_SIZES = (2000, 500)  # (train, test) used by load_dataset("synthetic")


@dataclass(frozen=True)
class Dataset:
    """Inputs and integer labels of one split, held in memory.

    ``x`` is float32 images ``(N, C, H, W)`` or features ``(N, D)`` already normalized, or int64 token ids ``(N, L)``;
    ``y`` is int64 ``(N,)`` with values in ``[0, num_classes)``.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.x, np.ndarray) or not isinstance(self.y, np.ndarray):
            raise DatasetError(f"dataset {self.name!r}: x and y must be numpy arrays")
        if self.x.dtype not in (np.float32, np.int64):
            raise DatasetError(
                f"dataset {self.name!r}: x must be float32 (inputs) or int64 (token ids), got {self.x.dtype}"
            )
        if self.x.ndim < 2:
            raise DatasetError(f"dataset {self.name!r}: x must have shape (N, ...) with ndim >= 2, got {self.x.shape}")
        if self.y.dtype != np.int64 or self.y.ndim != 1:
            raise DatasetError(
                f"dataset {self.name!r}: y must be int64 of shape (N,), got {self.y.dtype} {self.y.shape}"
            )
        if len(self.x) != len(self.y):
            raise DatasetError(f"dataset {self.name!r}: {len(self.x)} inputs but {len(self.y)} labels")
        if self.num_classes < 1:
            raise DatasetError(f"dataset {self.name!r}: num_classes must be >= 1, got {self.num_classes}")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise DatasetError(
                f"dataset {self.name!r}: labels must lie in [0, {self.num_classes}), "
                f"found [{self.y.min()}, {self.y.max()}]"
            )

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input, ``x.shape[1:]``."""
        return tuple(self.x.shape[1:])

    def subset(self, indices: np.ndarray) -> Dataset:
        """The samples at ``indices`` (a 1-D integer array), in that order."""
        indices = np.asarray(indices)
        if indices.ndim != 1 or not (indices.dtype.kind in "iu" or indices.size == 0):
            raise DatasetError(
                f"dataset {self.name!r}: subset indices must be a 1-D integer array, got {indices.dtype}"
            )
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise DatasetError(f"dataset {self.name!r}: subset index out of range for {len(self)} samples")
        indices = indices.astype(np.int64, copy=False)
        return Dataset(x=self.x[indices], y=self.y[indices], num_classes=self.num_classes, name=self.name)


# --------------------------------------------------------------------------------------------------------------- IDX


def _idx_layout(directory: Path) -> str:
    names = ", ".join(_IDX_FILES)
    return f"expected in {directory}: {names} (gzip'd, or the same names without .gz)"


def _find_idx_file(directory: Path, gz_name: str) -> Path:
    gz_path = directory / gz_name
    if gz_path.is_file():
        return gz_path
    raw_path = directory / gz_name.removesuffix(".gz")
    if raw_path.is_file():
        return raw_path
    where = "" if directory.is_dir() else f" (directory {directory} does not exist)"
    raise DatasetError(f"missing dataset file {gz_path} (nor {raw_path.name}){where}; {_idx_layout(directory)}")


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{path} is not a valid gzip file ({exc}); re-download it or gunzip it by hand") from exc


def _header(path: Path, data: bytes, num_ints: int) -> tuple[int, ...]:
    if len(data) < 4 * num_ints:
        raise DatasetError(f"{path} is truncated: {len(data)} bytes, shorter than its {4 * num_ints}-byte IDX header")
    return tuple(int(v) for v in np.frombuffer(data, dtype=">i4", count=num_ints))


def _check_payload(path: Path, data: bytes, header_bytes: int, expected: int) -> np.ndarray:
    actual = len(data) - header_bytes
    if actual != expected:
        problem = "truncated" if actual < expected else "longer than its header says"
        raise DatasetError(f"{path} is {problem}: header promises {expected} data bytes, file holds {actual}")
    return np.frombuffer(data, dtype=np.uint8, offset=header_bytes)


def _read_idx_images(path: Path) -> np.ndarray:
    """uint8 images ``(N, rows, cols)`` from an IDX3 file."""
    data = _read_bytes(path)
    magic, count, rows, cols = _header(path, data, 4)
    if magic != _IDX_IMAGES_MAGIC:
        raise DatasetError(f"{path} is not an IDX image file: magic number {magic}, expected {_IDX_IMAGES_MAGIC}")
    if count < 0 or rows <= 0 or cols <= 0:
        raise DatasetError(f"{path} has an invalid header: count={count}, rows={rows}, cols={cols}")
    return _check_payload(path, data, 16, count * rows * cols).reshape(count, rows, cols)


def _read_idx_labels(path: Path) -> np.ndarray:
    """uint8 labels ``(N,)`` from an IDX1 file."""
    data = _read_bytes(path)
    magic, count = _header(path, data, 2)
    if magic != _IDX_LABELS_MAGIC:
        raise DatasetError(f"{path} is not an IDX label file: magic number {magic}, expected {_IDX_LABELS_MAGIC}")
    if count < 0:
        raise DatasetError(f"{path} has an invalid header: count={count}")
    return _check_payload(path, data, 8, count)


def _read_idx_split(directory: Path, images_name: str, labels_name: str) -> tuple[np.ndarray, np.ndarray]:
    images_path = _find_idx_file(directory, images_name)
    labels_path = _find_idx_file(directory, labels_name)
    images = _read_idx_images(images_path)
    labels = _read_idx_labels(labels_path)
    if len(images) != len(labels):
        raise DatasetError(
            f"count mismatch: {images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels"
        )
    return images, labels


def load_idx_dir(directory: str | Path, name: str) -> tuple[Dataset, Dataset]:
    """MNIST-style train/test splits from the four IDX files in ``directory``, as ``(N, 1, rows, cols)`` float32.

    Pixels are scaled to [0, 1] and standardized with the dataset's published mean/std when ``name`` is known
    (``"mnist"``, ``"fashion_mnist"``), otherwise with the mean/std of the training images. Decoded once, then read
    from :mod:`fedge.data.cache` (keyed by the files' bytes).
    """
    directory = Path(directory)
    sources = [_find_idx_file(directory, f) for f in _IDX_FILES]
    recipe = f"idx/1 {name} {_IDX_NORMALIZATION.get(name)}"  # bump the version when decoding changes
    return cached_splits(sources, recipe, lambda: _decode_idx_dir(directory, name), Dataset)


def _decode_idx_dir(directory: Path, name: str) -> tuple[Dataset, Dataset]:
    train_images, train_labels = _read_idx_split(directory, _IDX_FILES[0], _IDX_FILES[1])
    test_images, test_labels = _read_idx_split(directory, _IDX_FILES[2], _IDX_FILES[3])
    if train_images.shape[1:] != test_images.shape[1:]:
        raise DatasetError(
            f"train images in {directory} are {train_images.shape[1:]} but test images are {test_images.shape[1:]}"
        )
    if name in _IDX_NORMALIZATION:
        mean, std = _IDX_NORMALIZATION[name]
    else:
        # Exact statistics from the 256-bin histogram: deterministic and far cheaper than a float pass.
        hist = np.bincount(train_images.ravel(), minlength=256).astype(np.float64)
        values = np.arange(256, dtype=np.float64) / 255.0
        total = max(hist.sum(), 1.0)
        mean = float(hist @ values / total)
        std = math.sqrt(float(hist @ (values - mean) ** 2 / total)) or 1.0
    max_label = int(max(train_labels.max(initial=0), test_labels.max(initial=0)))
    num_classes = 10 if name in _IDX_NORMALIZATION else max_label + 1
    if max_label >= num_classes:
        raise DatasetError(f"labels in {directory} go up to {max_label}, but {name} has {num_classes} classes")

    scale, shift = np.float32(1.0 / (255.0 * std)), np.float32(mean / std)

    def split(images: np.ndarray, labels: np.ndarray) -> Dataset:
        x = images[:, None, :, :].astype(np.float32)  # (N, 1, rows, cols)
        # In place: the MNIST train split is 188 MB of float32, so avoid temporaries.
        x *= scale
        x -= shift
        return Dataset(x=x, y=labels.astype(np.int64), num_classes=num_classes, name=name)

    return split(train_images, train_labels), split(test_images, test_labels)


def load_mnist(directory: str | Path) -> tuple[Dataset, Dataset]:
    """MNIST (60,000 / 10,000 images, 1x28x28, 10 classes) from its IDX files in ``directory``."""
    return load_idx_dir(directory, "mnist")


def load_fashion_mnist(directory: str | Path) -> tuple[Dataset, Dataset]:
    """Fashion-MNIST (60,000 / 10,000 images, 1x28x28, 10 classes) from its IDX files in ``directory``."""
    return load_idx_dir(directory, "fashion_mnist")


# ---------------------------------------------------------------------------------------------------------- CIFAR-10


def _cifar_layout(directory: Path) -> str:
    names = ", ".join((*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE))
    return f"expected in {directory}: {names} (the CIFAR-10 binary version; at least one data batch)"


def _read_cifar_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images ``(N, 3, 32, 32)`` and labels ``(N,)`` from one CIFAR-10 binary batch."""
    data = _read_bytes(path)
    if len(data) == 0 or len(data) % _CIFAR_RECORD:
        raise DatasetError(
            f"{path} is not a CIFAR-10 binary batch: {len(data)} bytes is not a positive multiple of "
            f"the {_CIFAR_RECORD}-byte record (1 label byte + 3072 pixel bytes)"
        )
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, _CIFAR_RECORD)
    labels = records[:, 0]
    if labels.max() >= _CIFAR_CLASSES:
        raise DatasetError(f"{path} has label {labels.max()}; CIFAR-10 labels are 0..9")
    images = records[:, 1:].reshape(-1, 3, _CIFAR_SIDE, _CIFAR_SIDE)
    return images, labels


def load_cifar10(directory: str | Path) -> tuple[Dataset, Dataset]:
    """CIFAR-10 train/test splits (``(N, 3, 32, 32)`` float32, per-channel standardized) from its binary batches.

    ``directory`` holds ``test_batch.bin`` and any non-empty subset of ``data_batch_1.bin`` ... ``data_batch_5.bin``
    (or is the parent of the official ``cifar-10-batches-bin`` folder).
    """
    directory = Path(directory)
    if not (directory / _CIFAR_TEST_FILE).is_file() and (directory / _CIFAR_SUBDIR).is_dir():
        directory = directory / _CIFAR_SUBDIR
    test_path = directory / _CIFAR_TEST_FILE
    if not test_path.is_file():
        raise DatasetError(f"missing dataset file {test_path}; {_cifar_layout(directory)}")
    train_paths = [directory / n for n in _CIFAR_TRAIN_FILES if (directory / n).is_file()]
    if not train_paths:
        raise DatasetError(f"missing dataset files: no data_batch_*.bin in {directory}; {_cifar_layout(directory)}")

    parts = [_read_cifar_file(p) for p in train_paths]
    train_images = np.concatenate([images for images, _ in parts])
    train_labels = np.concatenate([labels for _, labels in parts])
    test_images, test_labels = _read_cifar_file(test_path)

    mean = np.asarray(_CIFAR_MEAN, dtype=np.float32)[None, :, None, None]  # (1, 3, 1, 1)
    std = np.asarray(_CIFAR_STD, dtype=np.float32)[None, :, None, None]

    def split(images: np.ndarray, labels: np.ndarray) -> Dataset:
        x = (images.astype(np.float32) / np.float32(255.0) - mean) / std
        return Dataset(x=x, y=labels.astype(np.int64), num_classes=_CIFAR_CLASSES, name="cifar10")

    return split(train_images, train_labels), split(test_images, test_labels)


# --------------------------------------------------------------------------------------------- in-memory datasets


def load_digits_dataset(test_fraction: float = 0.25, seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's 1,797 handwritten digits (``(N, 1, 8, 8)``, 10 classes), split stratified by ``seed``.

    Pixels (0..16) are scaled to [0, 1] and standardized with the training split's mean/std.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    # Importing scikit-learn costs about 2 CPU s, paid by every process that loads the digits (each worker, client and
    # test subprocess): the split is cached as the decoded datasets are, keyed by scikit-learn's own data file and
    # version (its split function decides the order), so only the first process imports it.
    source = _sklearn_digits_file()
    if source is None:
        return _split_digits(test_fraction, seed)
    recipe = f"digits/1 scikit-learn {importlib.metadata.version('scikit-learn')} {test_fraction!r} {seed}"
    return cached_splits([source], recipe, lambda: _split_digits(test_fraction, seed), Dataset)


def _sklearn_digits_file() -> Path | None:
    """scikit-learn's bundled digits file, found without importing scikit-learn (None: not where expected)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def _split_digits(test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    from sklearn.datasets import load_digits  # imported here: scikit-learn is slow to import and only needed here
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0)[:, None, :, :]  # (N, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    mean, std = float(x_train.mean()), float(x_train.std())
    train = Dataset(x=((x_train - mean) / std).astype(np.float32), y=y_train, num_classes=10, name="digits")
    test = Dataset(x=((x_test - mean) / std).astype(np.float32), y=y_test, num_classes=10, name="digits")
    return train, test


def make_synthetic(
    num_train: int,
    num_test: int,
    num_classes: int = 10,
    input_shape: Sequence[int] = (1, 8, 8),
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """A learnable classification task: each class is a Gaussian blob around its own random mean in input space.

    Classes are balanced (up to one sample), both splits share the class means, and the result depends only on the
    arguments, so a small MLP or CNN gets well above chance in a few epochs.
    """
    shape = tuple(int(d) for d in input_shape)
    if num_train < 1 or num_test < 1:
        raise ConfigError(f"num_train and num_test must be >= 1, got {num_train} and {num_test}")
    if num_classes < 2:
        raise ConfigError(f"num_classes must be >= 2, got {num_classes}")
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"input_shape must be non-empty with positive sides, got {shape}")
    rng = np.random.default_rng(seed)
    dim = math.prod(shape)
    # Unit noise; mean scale chosen so neighbouring class means sit ~2.8 noise stds from their midpoint at
    # dim=64 and further apart for bigger inputs, yet a tiny input is still separable well above chance.
    means = rng.standard_normal((num_classes, dim)) * max(0.5, 3.0 / math.sqrt(dim))  # (C, D)

    def split(n: int) -> Dataset:
        y = rng.permutation(np.arange(n, dtype=np.int64) % num_classes)
        x = means[y] + rng.standard_normal((n, dim))  # (N, D)
        return Dataset(x=x.astype(np.float32).reshape(n, *shape), y=y, num_classes=num_classes, name="synthetic")

    train = split(num_train)
    return train, split(num_test)


# ---------------------------------------------------------------------------------------------------------- registry


def _resolve_dir(data_dir: Path, name: str) -> Path:
    # Accept either the folder that holds the files or a data root with one folder per dataset (../shared/data).
    for sub in (name, name.replace("_", "-")):
        if (data_dir / sub).is_dir():
            return data_dir / sub
    return data_dir


def load_dataset(name: str, data_dir: str | Path | None = None, *, seed: int = 0) -> tuple[Dataset, Dataset]:
    """The ``(train, test)`` splits of the dataset called ``name`` (one of :data:`DATASETS`, or a plugin's).

    File-backed datasets (mnist, fashion_mnist, cifar10) read ``data_dir``, which is either the folder holding the
    files or a data root with a ``<name>/`` subfolder. ``seed`` fixes the split of digits and the synthetic task.
    """
    if name not in DATASETS:
        arrays = plugins.plugin_dataset_arrays(name, data_dir, seed)
        if arrays is not None:
            return checked_splits(name, arrays)
        raise ConfigError(
            f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}"
            + "".join(f", {n} (plugin)" for n in plugins.plugin_dataset_names())
            + f"; a dataset of your own: --plugin MODULE_OR_FILE or {plugins.ENV} (docs/custom_models.md)"
        )
    if name == "digits":
        return load_digits_dataset(seed=seed)
    if name == "synthetic":
        return make_synthetic(*_SYNTHETIC_SIZES, seed=seed)
    if data_dir is None:
        raise DatasetError(
            f"dataset {name!r} is read from files: pass a data directory (--data-dir DIR) holding {name}/ "
            f"or the files themselves"
        )
    return _FILE_LOADERS[name](_resolve_dir(Path(data_dir), name))


_FILE_LOADERS: dict[str, Callable[[Path], tuple[Dataset, Dataset]]] = {
    "mnist": load_mnist,
    "fashion_mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
}


# ------------------------------------------------------------------------------------------- your own datasets


def checked_splits(name: str, arrays: object) -> tuple[Dataset, Dataset]:
    """:class:`DatasetArrays` as checked ``(train, test)`` datasets; one-line :class:`PluginError` on anything off."""
    where = f"dataset {name!r}"
    if not isinstance(arrays, DatasetArrays):
        raise PluginError(f"{where}: the loader must return fedge.plugins.DatasetArrays, got {type(arrays).__name__}")
    num_classes = arrays.num_classes
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
        raise PluginError(f"{where}: num_classes must be an integer >= 2, got {num_classes!r}")
    train = _split(name, "train", arrays.x_train, arrays.y_train, int(num_classes))
    test = _split(name, "test", arrays.x_test, arrays.y_test, int(num_classes))
    if train.x.shape[1:] != test.x.shape[1:] or train.x.dtype != test.x.dtype:
        raise PluginError(
            f"{where}: train inputs are {train.x.dtype} {train.x.shape[1:]} per sample but test inputs are "
            f"{test.x.dtype} {test.x.shape[1:]}"
        )
    return train, test


def _split(name: str, split: str, x: object, y: object, num_classes: int) -> Dataset:
    where = f"dataset {name!r}"
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise PluginError(
            f"{where}: x_{split} and y_{split} must be numpy arrays, got {type(x).__name__} and {type(y).__name__}"
        )
    if x.ndim < 2 or len(x) == 0:
        raise PluginError(f"{where}: x_{split} must have shape (N, ...) with N >= 1 and ndim >= 2, got {x.shape}")
    if x.dtype.kind == "f":
        x = x.astype(np.float32, copy=False)
        if not np.isfinite(x).all():
            raise PluginError(f"{where}: x_{split} holds NaN or infinite values (or values beyond float32)")
    elif x.dtype.kind in "iu":
        if x.min() < 0 or int(x.max()) >= 2**63:  # a negative or wrapped id would reach an embedding as a traceback
            raise PluginError(f"{where}: x_{split} token ids must be in [0, 2**63), got {x.min()}..{x.max()}")
        x = x.astype(np.int64, copy=False)  # token ids, e.g. for an embedding
    else:
        raise PluginError(f"{where}: x_{split} must be floating-point inputs or integer token ids, got {x.dtype}")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise PluginError(f"{where}: y_{split} must be integer labels of shape (N,), got {y.dtype} {y.shape}")
    if len(y) != len(x):
        raise PluginError(f"{where}: x_{split} holds {len(x)} samples but y_{split} holds {len(y)} labels")
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= num_classes:
        raise PluginError(f"{where}: y_{split} labels must lie in [0, {num_classes}), found [{low}, {high}]")
    return Dataset(x=np.ascontiguousarray(x), y=y.astype(np.int64), num_classes=num_classes, name=name)


plugins.reserve_builtin_names("dataset", DATASETS)
