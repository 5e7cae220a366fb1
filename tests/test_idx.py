"""IDX reading: valid files round-trip, every kind of corruption is named, real Fashion-MNIST loads."""

from __future__ import annotations

import dataclasses
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from vertical.datasets import get_spec, load
from vertical.datasets.idx import IdxFormatError, load_idx_image_dataset, read_idx
from vertical.datasets.paths import data_dir_candidates

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B,
             np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">HBB", 0, IDX_CODES[array.dtype], array.ndim)
    return header + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write(path: Path, content: bytes) -> Path:
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(content))
    else:
        path.write_bytes(content)
    return path


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, ">i2", ">i4", ">f4", ">f8"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_valid_files_round_trip(tmp_path: Path, dtype: str, suffix: str) -> None:
    array = (np.arange(2 * 3 * 4) - 5).reshape(2, 3, 4).astype(dtype)
    if np.dtype(dtype) == np.uint8:
        array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    got = read_idx(write(tmp_path / f"a.idx{suffix}", idx_bytes(array)))
    assert got.shape == (2, 3, 4)
    assert got.dtype.isnative
    assert np.array_equal(got, array)


GOOD = idx_bytes(np.arange(12, dtype=np.uint8).reshape(3, 4))


@pytest.mark.parametrize(("content", "message"), [
    (b"\x01\x00" + GOOD[2:], "bad magic number"),
    (GOOD[:2] + b"\x07" + GOOD[3:], "unknown IDX dtype code 0x07"),
    (GOOD[:3] + b"\x00" + GOOD[4:], "declares 0 dimensions"),
    (GOOD[:6], "ends inside"),
    (GOOD[:-1], "payload is 11 bytes but the header's shape \\(3, 4\\)"),
    (GOOD + b"\x00", "payload is 13 bytes"),
    (b"\x00\x00", "too short"),
])
def test_corrupted_files_are_rejected_naming_the_file(tmp_path: Path, content: bytes, message: str) -> None:
    path = write(tmp_path / "bad-idx3-ubyte", content)
    with pytest.raises(IdxFormatError, match=message) as caught:
        read_idx(path)
    assert str(path) in str(caught.value)


def test_truncated_gzip_stream_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(GOOD)[:-10])
    with pytest.raises(IdxFormatError, match="cannot read the file") as caught:
        read_idx(path)
    assert str(path) in str(caught.value)


def small_image_set(folder: Path, n_train: int, n_test: int, labels: np.ndarray | None = None) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = labels if labels is not None and prefix == "train" else rng.integers(0, 10, n).astype(np.uint8)
        paths.append(write(folder / f"{prefix}-images-idx3-ubyte.gz", idx_bytes(images)))
        paths.append(write(folder / f"{prefix}-labels-idx1-ubyte.gz", idx_bytes(y)))
    return paths


def test_image_dataset_loader_flattens_to_unit_float32(tmp_path: Path) -> None:
    paths = small_image_set(tmp_path, 6, 4)
    spec = dataclasses.replace(get_spec("fashion-mnist"), n_rows=6, n_test_rows=4)
    ds = load_idx_image_dataset(spec, paths, seed=0)
    assert ds.X_train.shape == (6, 784) and ds.X_test.shape == (4, 784)
    assert ds.X_train.dtype == np.float32 and ds.X_train.min() >= 0.0 and ds.X_train.max() <= 1.0
    raw = read_idx(paths[0]).reshape(6, -1)
    assert np.allclose(ds.X_train * 255, raw)
    assert ds.y_train.dtype == np.int64 and np.array_equal(ds.y_train, read_idx(paths[1]))


def test_image_and_label_counts_must_agree(tmp_path: Path) -> None:
    paths = small_image_set(tmp_path, 6, 4, labels=np.zeros(5, dtype=np.uint8))
    spec = dataclasses.replace(get_spec("fashion-mnist"), n_rows=6, n_test_rows=4)
    with pytest.raises(IdxFormatError, match=r"holds 6 images but .* holds 5 labels"):
        load_idx_image_dataset(spec, paths, seed=0)


def test_registry_rejects_an_image_set_of_the_wrong_size(tmp_path: Path) -> None:
    (tmp_path / "fashion-mnist").mkdir()
    small_image_set(tmp_path / "fashion-mnist", 6, 4)
    with pytest.raises(ValueError, match="has 6 rows, expected 60,000"):
        load("fashion-mnist", data_dir=tmp_path)


def fashion_mnist_present() -> bool:
    system = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
    return system.is_file() or any((d / "fashion-mnist").is_dir() for d in data_dir_candidates())


@pytest.mark.data
@pytest.mark.skipif(not fashion_mnist_present(), reason="Fashion-MNIST files not in the shared data dir")
def test_real_fashion_mnist() -> None:
    ds = load("fashion-mnist")
    assert ds.X_train.shape == (60_000, 784) and ds.X_test.shape == (10_000, 784)
    assert ds.X_train.dtype == np.float32 and ds.X_train.max() == 1.0 and ds.X_train.min() == 0.0
    assert ds.n_classes == 10
    assert np.array_equal(np.bincount(ds.y_train), np.full(10, 6_000))  # Fashion-MNIST is balanced
    assert np.array_equal(np.bincount(ds.y_test), np.full(10, 1_000))
