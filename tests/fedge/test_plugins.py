"""Your own model and dataset (fedge.plugins): how they get in, and that what they return is checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from plugin_support import fresh_plugins  # noqa: F401 - pytest fixture
from torch import nn

from fedge import plugins
from fedge.data.datasets import checked_splits, load_dataset
from fedge.errors import ConfigError, DatasetError
from fedge.learning.models import build_model, default_model_for
from fedge.plugins import DatasetArrays, PluginError, load_class_folders, register_dataset

PLUGIN = """
import numpy as np
from torch import nn
from fedge.plugins import DatasetArrays, register_dataset, register_model

class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(input_shape[0], num_classes)

    def forward(self, x):
        return self.fc(x)

def blobs(data_dir, seed):
    rng = np.random.default_rng(seed)
    y = np.arange(40) % 2
    x = rng.standard_normal((40, 5)) + 3.0 * y[:, None]
    return DatasetArrays(x[:30], y[:30], x[30:], y[30:], num_classes=2)

register_model("{model}", Net)
register_dataset("blobs", blobs, default_model="{model}")
"""


# Each test starts with no plugin registered or imported, and no FEDGE_PLUGINS.
pytestmark = pytest.mark.usefixtures("fresh_plugins")


def write_plugin(tmp_path: Path, name: str = "my_plugin.py", model: str = "blob_net") -> Path:
    path = tmp_path / name
    path.write_text(PLUGIN.format(model=model))
    return path


def test_a_file_named_in_the_environment_registers_a_model_and_a_dataset(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(plugins.ENV, str(write_plugin(tmp_path)))
    train, test = load_dataset("blobs", seed=1)
    assert (train.x.dtype, train.x.shape, test.x.shape, train.num_classes) == (np.float32, (30, 5), (10, 5), 2)
    assert default_model_for("blobs") == "blob_net"
    model = build_model("blob_net", input_shape=(5,), num_classes=2, seed=0)
    assert model.input_shape == (5,)  # set for the exporters when the plugin's model has none
    again = build_model("blob_net", input_shape=(5,), num_classes=2, seed=0)
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


def test_an_installed_packages_entry_points_register_their_names(tmp_path: Path, monkeypatch):
    # A real distribution on sys.path, as `pip install` leaves one: its entry_points.txt names the objects.
    (tmp_path / "blob_pkg.py").write_text(
        PLUGIN.replace('register_model("{model}", Net)', "").replace(
            'register_dataset("blobs", blobs, default_model="{model}")',
            "from fedge.plugins import DatasetPlugin\nWITH_DEFAULT = DatasetPlugin(blobs, default_model='ep_net')",
        )
    )
    info = tmp_path / "blob_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: blob-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[fedge.models]\nep_net = blob_pkg:Net\n\n"
        "[fedge.datasets]\nep_blobs = blob_pkg:blobs\nep_blobs2 = blob_pkg:WITH_DEFAULT\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "ep_net" in plugins.plugin_model_names() and "ep_blobs" in plugins.plugin_dataset_names()
    assert build_model("ep_net", input_shape=(5,), num_classes=2).fc.out_features == 2
    assert len(load_dataset("ep_blobs")[0]) == 30
    with pytest.raises(ConfigError, match="names no default model: pass --model"):
        default_model_for("ep_blobs")
    assert default_model_for("ep_blobs2") == "ep_net"  # an entry point to a DatasetPlugin carries its default model


def test_a_name_of_a_built_in_or_of_another_plugin_is_refused(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(plugins.ENV, str(write_plugin(tmp_path, model="fedavg_cnn")))
    with pytest.raises(PluginError, match="'fedavg_cnn' collides with fedge's built-in model"):
        plugins.load_plugins()
    with pytest.raises(PluginError, match="dataset 'digits' collides with fedge's built-in dataset"):
        register_dataset("digits", lambda data_dir, seed: None)
    register_dataset("mine", lambda data_dir, seed: None)
    with pytest.raises(PluginError, match="'mine' is already registered by your code"):
        register_dataset("mine", lambda data_dir, seed: None)


def test_unknown_names_say_how_to_bring_your_own(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"unknown model 'nope'.*--plugin MODULE_OR_FILE or FEDGE_PLUGINS"):
        build_model("nope", input_shape=(5,), num_classes=2)
    with pytest.raises(ConfigError, match=r"unknown dataset 'nope'.*--plugin"):
        load_dataset("nope")
    with pytest.raises(PluginError, match=r"plugin file .*missing.py does not exist"):
        plugins.load_plugins([str(tmp_path / "missing.py")])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(PluginError, match="failed while importing: RuntimeError: no GPU here"):
        plugins.load_plugins([str(broken)])


def arrays(**changes: object) -> DatasetArrays:
    x = np.zeros((4, 3), dtype=np.float64)
    y = np.array([0, 1, 2, 1])
    base: dict[str, object] = {"x_train": x, "y_train": y, "x_test": x[:2], "y_test": y[:2], "num_classes": 3}
    return DatasetArrays(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"y_train": np.array([0, 1, 3, 1])}, r"y_train labels must lie in \[0, 3\), found \[0, 3\]"),
        ({"y_test": np.array([-1, 0])}, r"y_test labels must lie in \[0, 3\)"),
        ({"y_train": np.array([0.0, 1.0, 2.0, 1.0])}, "y_train must be integer labels"),
        ({"x_train": np.zeros((4, 3), dtype=object)}, "x_train must be floating-point inputs or integer token ids"),
        ({"x_train": np.full((4, 3), np.nan)}, "x_train holds NaN or infinite values"),
        (
            {"x_test": np.zeros((2, 4))},
            r"train inputs are float32 \(3,\) per sample but test inputs are float32 \(4,\)",
        ),
        ({"x_train": np.zeros(4)}, r"x_train must have shape \(N, ...\)"),
        ({"y_train": np.array([0, 1, 2])}, "x_train holds 4 samples but y_train holds 3 labels"),
        ({"x_train": [[0.0]] * 4}, "x_train and y_train must be numpy arrays, got list"),
        ({"num_classes": 1}, "num_classes must be an integer >= 2"),
    ],
)
def test_what_a_dataset_returns_is_checked(changes: dict[str, object], message: str):
    with pytest.raises(PluginError, match=message):
        checked_splits("mine", arrays(**changes))


def test_checked_arrays_become_float32_and_int64():
    train, test = checked_splits("mine", arrays(y_train=np.array([0, 1, 2, 1], dtype=np.uint8)))
    assert (train.x.dtype, train.y.dtype, test.y.dtype, train.name) == (np.float32, np.int64, np.int64, "mine")
    with pytest.raises(PluginError, match=r"must return fedge.plugins.DatasetArrays, got tuple"):
        checked_splits("mine", (1, 2))


def test_a_model_that_does_not_fit_is_refused_with_its_name(tmp_path: Path):
    plugins.register_model("wide", lambda shape, classes: nn.Linear(7, classes))
    plugins.register_model("no_module", lambda shape, classes: "a string")
    net = build_model("wide", input_shape=(5,), num_classes=2)
    with pytest.raises(PluginError, match=r"model 'wide' cannot take the dataset's inputs \(float32 \(5,\)"):
        plugins.check_model_on("wide", net, np.zeros((2, 5), dtype=np.float32), 2)
    with pytest.raises(PluginError, match=r"must return logits of shape \(N, 3\) for N samples; for 2 it returned"):
        plugins.check_model_on("wide", net, np.zeros((2, 7), dtype=np.float32), 3)
    with pytest.raises(PluginError, match=r"model 'no_module': the factory returned str, not a torch nn.Module"):
        build_model("no_module", input_shape=(5,), num_classes=2)


def test_class_folders_read_one_npy_file_per_sample(tmp_path: Path):
    for split, counts in (("train", (3, 2)), ("test", (1, 1))):
        for cls, n in zip(("ants", "bees"), counts, strict=True):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                np.save(folder / f"{i}.npy", np.full((2, 2), i, dtype=np.float32))
    loaded = load_class_folders(tmp_path)
    assert loaded.x_train.shape == (5, 2, 2) and loaded.y_train.tolist() == [0, 0, 0, 1, 1]
    assert loaded.y_test.tolist() == [0, 1] and loaded.num_classes == 2
    np.save(tmp_path / "test" / "bees" / "odd.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(DatasetError, match=r"odd.npy has shape \(3,\), the samples before it \(2, 2\)"):
        load_class_folders(tmp_path)
    (tmp_path / "test" / "wasps").mkdir()
    with pytest.raises(DatasetError, match=r"has class folders \['wasps'\] that .*train lacks"):
        load_class_folders(tmp_path)
    with pytest.raises(DatasetError, match="pass --data-dir DIR holding train/ and test/"):
        load_class_folders(None)
    (tmp_path / "train" / "ants" / "0.npy").write_bytes(b"not numpy")
    (tmp_path / "test" / "wasps").rmdir()
    (tmp_path / "test" / "bees" / "odd.npy").unlink()
    with pytest.raises(DatasetError, match=r"cannot read .*0.npy as a numpy .npy array"):
        load_class_folders(tmp_path)


def test_a_plugin_is_imported_once_whatever_the_path_spelling(tmp_path: Path, monkeypatch):
    path = write_plugin(tmp_path)
    monkeypatch.setenv(plugins.ENV, str(path))
    monkeypatch.chdir(tmp_path)
    plugins.load_plugins(["./my_plugin.py"])  # the same file again: no "already registered" error
    assert plugins.plugin_model_names() == ["blob_net"]


def test_moon_with_a_plugin_model_without_a_representation_split_is_refused_before_the_run(tmp_path: Path, monkeypatch):
    from fedge.config import RunConfig
    from fedge_io.experiment import prepare

    monkeypatch.setenv(plugins.ENV, str(write_plugin(tmp_path)))
    with pytest.raises(ConfigError, match=r"moon compares the model's representations, but model 'blob_net' has no"):
        prepare(RunConfig(algorithm="moon", dataset="blobs", num_clients=2))
    prepare(RunConfig(algorithm="fedavg", dataset="blobs", num_clients=2))  # the same model suits FedAvg
