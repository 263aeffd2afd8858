"""Tests for fedge.data.datasets: real MNIST/Fashion-MNIST, IDX and CIFAR-10 files written here, digits, synthetic,
registry."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import numpy as np
import pytest

from fedge.data.datasets import (
    DATASETS,
    Dataset,
    load_cifar10,
    load_dataset,
    load_digits_dataset,
    load_fashion_mnist,
    load_idx_dir,
    load_mnist,
    make_synthetic,
)
from fedge.errors import ConfigError, DatasetError

SHARED = Path(__file__).resolve().parents[2].parent / "shared"  # the project's sibling folder, there in CI too
SHARED_DATA = SHARED / "data"
IDX_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


# ----------------------------------------------------------------------------------------------------------- helpers


def write_file(path: Path, payload: bytes) -> None:
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


def idx_images(images: np.ndarray, *, magic: int = 2051, count: int | None = None) -> bytes:
    n, rows, cols = images.shape
    header = np.array([magic, n if count is None else count, rows, cols], dtype=">i4").tobytes()
    return header + images.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray, *, magic: int = 2049, count: int | None = None) -> bytes:
    header = np.array([magic, len(labels) if count is None else count], dtype=">i4").tobytes()
    return header + labels.astype(np.uint8).tobytes()


def write_idx_dir(directory: Path, *, gz: bool = True, n_train: int = 12, n_test: int = 5) -> dict[str, np.ndarray]:
    """Four small IDX files with known content; returns the raw arrays."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {
        "train_x": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_y": np.arange(n_train) % 10,
        "test_x": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_y": (np.arange(n_test) * 3) % 10,
    }
    payloads = (
        idx_images(arrays["train_x"]),
        idx_labels(arrays["train_y"]),
        idx_images(arrays["test_x"]),
        idx_labels(arrays["test_y"]),
    )
    for name, payload in zip(IDX_NAMES, payloads, strict=True):
        write_file(directory / (name if gz else name.removesuffix(".gz")), payload)
    return arrays


def cifar_records(labels: list[int], seed: int) -> tuple[bytes, np.ndarray]:
    """CIFAR-10 binary records for ``labels``; returns the bytes and the pixels as (N, 3, 32, 32) uint8."""
    pixels = np.random.default_rng(seed).integers(0, 256, (len(labels), 3, 32, 32), dtype=np.uint8)
    records = np.concatenate([np.array(labels, dtype=np.uint8)[:, None], pixels.reshape(len(labels), -1)], axis=1)
    return records.tobytes(), pixels


# --------------------------------------------------------------------------------------------------- real datasets


def _require_real_data(name: str) -> None:
    """Skip only outside a checkout with ../shared; where ../shared exists, missing data is a failure, not a skip."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the real datasets) is not next to this checkout")
    assert (SHARED_DATA / name).is_dir(), f"{SHARED_DATA / name} is missing"


@pytest.fixture(scope="module")
def mnist() -> tuple[Dataset, Dataset, float]:
    _require_real_data("mnist")
    start = time.perf_counter()
    train, test = load_mnist(SHARED_DATA / "mnist")
    return train, test, time.perf_counter() - start


@pytest.fixture(scope="module")
def fashion_mnist() -> tuple[Dataset, Dataset]:
    _require_real_data("fashion_mnist")
    return load_fashion_mnist(SHARED_DATA / "fashion_mnist")


def check_real_split(train: Dataset, test: Dataset, name: str) -> None:
    assert (len(train), len(test)) == (60_000, 10_000)
    assert train.x.shape == (60_000, 1, 28, 28) and test.x.shape == (10_000, 1, 28, 28)
    assert train.input_shape == (1, 28, 28)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert train.num_classes == test.num_classes == 10
    assert train.name == name
    # Standardized with the published train statistics, so train is ~N(0, 1) per pixel overall.
    assert abs(float(train.x.mean())) < 0.01
    assert abs(float(train.x.std()) - 1.0) < 0.01
    assert abs(float(test.x.mean())) < 0.05


def test_mnist_real(mnist: tuple[Dataset, Dataset, float]) -> None:
    train, test, elapsed = mnist
    check_real_split(train, test, "mnist")
    train_hist, test_hist = np.bincount(train.y, minlength=10), np.bincount(test.y, minlength=10)
    assert train_hist.min() == 5421 and train_hist.max() == 6742  # digits 5 and 1
    assert test_hist.sum() == 10_000 and test_hist.min() > 800
    # Background pixels (0) map to -mean/std.
    assert float(train.x.min()) == pytest.approx(-0.1307 / 0.3081, abs=1e-6)
    # A loose guard against per-pixel Python loops (which take minutes); a vectorized load takes about a second.
    assert elapsed < 10.0


def test_fashion_mnist_real(fashion_mnist: tuple[Dataset, Dataset]) -> None:
    train, test = fashion_mnist
    check_real_split(train, test, "fashion_mnist")
    assert np.all(np.bincount(train.y, minlength=10) == 6000)
    assert np.all(np.bincount(test.y, minlength=10) == 1000)


def test_real_mnist_through_registry_data_root(mnist: tuple[Dataset, Dataset, float]) -> None:
    train, _, _ = mnist
    # The shared data root holds mnist/ and fashion_mnist/; load_dataset picks the subfolder.
    again, _ = load_dataset("mnist", SHARED_DATA)
    np.testing.assert_array_equal(again.y, train.y)
    np.testing.assert_array_equal(again.x[:100], train.x[:100])


# -------------------------------------------------------------------------------------------------------- IDX files


@pytest.mark.parametrize("gz", [True, False])
def test_idx_decodes_exact_pixels(tmp_path: Path, gz: bool) -> None:
    raw = write_idx_dir(tmp_path, gz=gz)
    train, test = load_idx_dir(tmp_path, "mnist")
    assert train.x.shape == (12, 1, 28, 28) and test.x.shape == (5, 1, 28, 28)
    np.testing.assert_array_equal(train.y, raw["train_y"])
    np.testing.assert_array_equal(test.y, raw["test_y"])
    expected = ((raw["test_x"] / 255.0 - 0.1307) / 0.3081)[:, None]
    np.testing.assert_allclose(test.x, expected, rtol=1e-5, atol=1e-5)


def test_idx_unknown_name_standardizes_with_train_statistics(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    train, test = load_idx_dir(tmp_path, "my_digits")
    assert abs(float(train.x.mean())) < 1e-5 and abs(float(train.x.std()) - 1.0) < 1e-4
    assert train.num_classes == 10 and test.name == "my_digits"
    again, _ = load_idx_dir(tmp_path, "my_digits")
    np.testing.assert_array_equal(again.x, train.x)


def test_idx_missing_file_names_path_and_layout(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError) as info:
        load_mnist(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "t10k-labels-idx1-ubyte.gz") in message
    assert all(name in message for name in IDX_NAMES)


def test_idx_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_mnist(tmp_path / "nowhere")


def test_idx_wrong_magic(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    write_file(tmp_path / IDX_NAMES[0], idx_images(np.zeros((12, 28, 28), np.uint8), magic=2049))
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte\.gz.*magic number 2049, expected 2051"):
        load_mnist(tmp_path)


def test_idx_truncated_data(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    write_file(tmp_path / IDX_NAMES[2], idx_images(np.zeros((5, 28, 28), np.uint8))[:-100])
    with pytest.raises(DatasetError, match=r"t10k-images-idx3-ubyte\.gz is truncated"):
        load_mnist(tmp_path)


def test_idx_truncated_header(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    write_file(tmp_path / IDX_NAMES[1], b"\x00\x00\x08")
    with pytest.raises(DatasetError, match=r"train-labels-idx1-ubyte\.gz is truncated.*header"):
        load_mnist(tmp_path)


def test_idx_header_count_disagrees_with_data(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    write_file(tmp_path / IDX_NAMES[1], idx_labels(np.zeros(12), count=10))
    with pytest.raises(DatasetError, match="longer than its header says"):
        load_mnist(tmp_path)


def test_idx_image_label_count_mismatch(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    write_file(tmp_path / IDX_NAMES[1], idx_labels(np.zeros(11)))
    with pytest.raises(DatasetError, match=r"count mismatch.*12 images.*11 labels"):
        load_mnist(tmp_path)


def test_idx_not_gzip(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    (tmp_path / IDX_NAMES[0]).write_bytes(idx_images(np.zeros((12, 28, 28), np.uint8)))  # raw bytes under a .gz name
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte\.gz is not a valid gzip file"):
        load_mnist(tmp_path)


def test_idx_truncated_gzip(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    path = tmp_path / IDX_NAMES[0]
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DatasetError, match="not a valid gzip file"):
        load_mnist(tmp_path)


def test_idx_label_out_of_range_for_known_dataset(tmp_path: Path) -> None:
    write_idx_dir(tmp_path)
    write_file(tmp_path / IDX_NAMES[3], idx_labels(np.array([0, 1, 2, 3, 10])))
    with pytest.raises(DatasetError, match="up to 10"):
        load_mnist(tmp_path)


# ---------------------------------------------------------------------------------------------------------- CIFAR-10


def test_cifar10_decodes_exact_pixels_and_labels(tmp_path: Path) -> None:
    batch1, pixels1 = cifar_records([i % 10 for i in range(20)], seed=1)
    batch3, pixels3 = cifar_records([9, 8, 7], seed=3)
    test_bytes, _ = cifar_records([3, 1, 4, 1, 5], seed=4)
    (tmp_path / "data_batch_1.bin").write_bytes(batch1)
    (tmp_path / "data_batch_3.bin").write_bytes(batch3)
    (tmp_path / "test_batch.bin").write_bytes(test_bytes)

    train, test = load_cifar10(tmp_path)
    assert train.x.shape == (23, 3, 32, 32) and test.x.shape == (5, 3, 32, 32)
    assert train.x.dtype == np.float32 and train.num_classes == 10 and train.name == "cifar10"
    np.testing.assert_array_equal(train.y, [i % 10 for i in range(20)] + [9, 8, 7])
    np.testing.assert_array_equal(test.y, [3, 1, 4, 1, 5])
    # Record 7, green plane, row 3, column 5: byte 1 + 1024 + 3 * 32 + 5 of the record.
    raw = batch1[7 * 3073 + 1 + 1024 + 3 * 32 + 5]
    assert raw == pixels1[7, 1, 3, 5]
    assert train.x[7, 1, 3, 5] == pytest.approx((raw / 255 - CIFAR_MEAN[1]) / CIFAR_STD[1], abs=1e-5)
    expected = (pixels3 / 255.0 - np.array(CIFAR_MEAN)[:, None, None]) / np.array(CIFAR_STD)[:, None, None]
    np.testing.assert_allclose(train.x[20:], expected, atol=1e-5)


def test_cifar10_accepts_official_subfolder(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    (folder / "data_batch_2.bin").write_bytes(cifar_records([1, 2], seed=0)[0])
    (folder / "test_batch.bin").write_bytes(cifar_records([3], seed=0)[0])
    train, test = load_dataset("cifar10", tmp_path)
    assert (len(train), len(test)) == (2, 1)


def test_cifar10_bad_size(tmp_path: Path) -> None:
    (tmp_path / "data_batch_1.bin").write_bytes(cifar_records([0, 1], seed=0)[0] + b"\x00")
    (tmp_path / "test_batch.bin").write_bytes(cifar_records([0], seed=0)[0])
    with pytest.raises(DatasetError, match=r"data_batch_1\.bin.*6147 bytes.*3073-byte record"):
        load_cifar10(tmp_path)


def test_cifar10_label_out_of_range(tmp_path: Path) -> None:
    (tmp_path / "data_batch_1.bin").write_bytes(cifar_records([0, 1], seed=0)[0])
    (tmp_path / "test_batch.bin").write_bytes(cifar_records([10], seed=0)[0])
    with pytest.raises(DatasetError, match=r"test_batch\.bin has label 10"):
        load_cifar10(tmp_path)


def test_cifar10_missing_test_batch(tmp_path: Path) -> None:
    (tmp_path / "data_batch_1.bin").write_bytes(cifar_records([0], seed=0)[0])
    with pytest.raises(DatasetError) as info:
        load_cifar10(tmp_path)
    assert str(tmp_path / "test_batch.bin") in str(info.value)
    assert "data_batch_5.bin" in str(info.value)


def test_cifar10_missing_all_train_batches(tmp_path: Path) -> None:
    (tmp_path / "test_batch.bin").write_bytes(cifar_records([0], seed=0)[0])
    with pytest.raises(DatasetError, match=r"no data_batch_\*\.bin"):
        load_cifar10(tmp_path)


# ----------------------------------------------------------------------------------------- digits and synthetic


def test_digits_shapes_and_stratified_split() -> None:
    train, test = load_digits_dataset()
    assert len(train) + len(test) == 1797 and len(test) == 450
    assert train.x.shape[1:] == (1, 8, 8) and train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert abs(float(train.x.mean())) < 1e-4 and abs(float(train.x.std()) - 1.0) < 1e-4
    test_share = np.bincount(test.y, minlength=10) / np.bincount(np.concatenate([train.y, test.y]), minlength=10)
    assert np.all(np.abs(test_share - 0.25) < 0.02)


def test_digits_deterministic_by_seed() -> None:
    a, _ = load_digits_dataset(seed=3)
    b, _ = load_digits_dataset(seed=3)
    c, _ = load_digits_dataset(seed=4)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.y, c.y)


def test_digits_rejects_bad_fraction() -> None:
    with pytest.raises(ConfigError, match="test_fraction"):
        load_digits_dataset(test_fraction=1.0)


def nearest_class_mean_accuracy(train: Dataset, test: Dataset) -> float:
    features_train = train.x.reshape(len(train), -1)
    features_test = test.x.reshape(len(test), -1)
    means = np.stack([features_train[train.y == c].mean(axis=0) for c in range(train.num_classes)])  # (C, D)
    distances = ((features_test[:, None, :] - means[None, :, :]) ** 2).sum(axis=-1)  # (N, C)
    return float((distances.argmin(axis=1) == test.y).mean())


@pytest.mark.parametrize("input_shape", [(1, 8, 8), (3, 4, 4), (20,)])
def test_synthetic_shapes_balance_and_learnable(input_shape: tuple[int, ...]) -> None:
    train, test = make_synthetic(600, 300, num_classes=10, input_shape=input_shape, seed=0)
    assert train.x.shape == (600, *input_shape) and test.x.shape == (300, *input_shape)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert np.all(np.bincount(train.y, minlength=10) == 60)
    assert nearest_class_mean_accuracy(train, test) > 0.8


def test_synthetic_deterministic_by_seed() -> None:
    a_train, a_test = make_synthetic(100, 50, seed=7)
    b_train, b_test = make_synthetic(100, 50, seed=7)
    c_train, _ = make_synthetic(100, 50, seed=8)
    np.testing.assert_array_equal(a_train.x, b_train.x)
    np.testing.assert_array_equal(a_test.y, b_test.y)
    assert not np.array_equal(a_train.x, c_train.x)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_train": 0, "num_test": 5}, "num_train"),
        ({"num_train": 5, "num_test": 5, "num_classes": 1}, "num_classes"),
        ({"num_train": 5, "num_test": 5, "input_shape": (1, 0, 8)}, "input_shape"),
    ],
)
def test_synthetic_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_synthetic(**kwargs)


# ---------------------------------------------------------------------------------------------------------- registry


def test_registry_unknown_name_lists_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset("imagenet")
    assert all(name in str(info.value) for name in DATASETS)


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10"])
def test_registry_file_dataset_needs_data_dir(name: str) -> None:
    with pytest.raises(DatasetError, match="data directory"):
        load_dataset(name)


def test_registry_in_memory_datasets() -> None:
    train, test = load_dataset("synthetic", seed=2)
    assert train.name == "synthetic" and train.input_shape == (1, 8, 8) and len(test) > 0
    again, _ = load_dataset("synthetic", seed=2)
    np.testing.assert_array_equal(again.x, train.x)
    digits, _ = load_dataset("digits", seed=1)
    assert digits.name == "digits"


def test_registry_finds_files_in_folder_or_data_root(tmp_path: Path) -> None:
    write_idx_dir(tmp_path / "fashion_mnist")
    from_root, _ = load_dataset("fashion_mnist", tmp_path)
    from_folder, _ = load_dataset("fashion_mnist", tmp_path / "fashion_mnist")
    assert from_root.name == "fashion_mnist" and len(from_root) == 12
    np.testing.assert_array_equal(from_root.x, from_folder.x)


# ----------------------------------------------------------------------------------------------------------- Dataset


def tiny_dataset(n: int = 6) -> Dataset:
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    return Dataset(x=x, y=np.arange(n, dtype=np.int64) % 3, num_classes=3, name="tiny")


def test_dataset_subset_and_shape() -> None:
    data = tiny_dataset()
    part = data.subset(np.array([4, 1]))
    assert len(part) == 2 and part.input_shape == (4,) and part.num_classes == 3 and part.name == "tiny"
    np.testing.assert_array_equal(part.y, [1, 1])
    np.testing.assert_array_equal(part.x[0], data.x[4])
    assert len(data.subset(np.array([], dtype=np.int64))) == 0


def test_dataset_token_ids_allowed() -> None:
    data = Dataset(x=np.zeros((3, 5), dtype=np.int64), y=np.zeros(3, dtype=np.int64), num_classes=2, name="text")
    assert data.input_shape == (5,)


@pytest.mark.parametrize(
    ("x", "y", "num_classes", "match"),
    [
        (np.zeros((3, 2), np.float32), np.zeros(2, np.int64), 2, "3 inputs but 2 labels"),
        (np.zeros((3, 2), np.float32), np.array([0, 1, 2]), 2, r"labels must lie in \[0, 2\)"),
        (np.zeros((3, 2), np.float32), np.array([0, -1, 1]), 2, "labels must lie"),
        (np.zeros((3, 2), np.float64), np.zeros(3, np.int64), 2, "x must be float32"),
        (np.zeros((3, 2), np.float32), np.zeros(3, np.int32), 2, "y must be int64"),
        (np.zeros(3, np.float32), np.zeros(3, np.int64), 2, "ndim >= 2"),
        (np.zeros((3, 2), np.float32), np.zeros(3, np.int64), 0, "num_classes"),
    ],
)
def test_dataset_validation(x: np.ndarray, y: np.ndarray, num_classes: int, match: str) -> None:
    with pytest.raises(DatasetError, match=match):
        Dataset(x=x, y=y, num_classes=num_classes, name="bad")


def test_dataset_subset_rejects_bad_indices() -> None:
    data = tiny_dataset()
    with pytest.raises(DatasetError, match="out of range"):
        data.subset(np.array([0, 6]))
    with pytest.raises(DatasetError, match="integer"):
        data.subset(np.array([0.5]))
