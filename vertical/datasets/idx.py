"""IDX files (MNIST, Fashion-MNIST), plain or gzip, read with every header field checked.

The format: two zero bytes, a dtype code, the number of dimensions ``ndim``, then ``ndim`` big-endian
uint32 sizes, then the row-major payload in big-endian. A file whose payload is shorter or longer than
the sizes promise (a truncated download, two files concatenated) is rejected, naming the file.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from vertical.datasets.base import Dataset, DatasetSpec, check_row_count
from vertical.datasets.paths import open_binary
from vertical.datasets.validation import DataValidationError, multiclass_labels

IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxFormatError(DataValidationError):
    """The bytes are not a well-formed IDX file."""


def read_idx(path: Path) -> np.ndarray:
    """The array stored in an IDX file (native byte order), after validating its header and length."""
    try:
        with open_binary(path) as stream:
            content = stream.read()
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise IdxFormatError(f"{path}: cannot read the file ({error})") from error
    if len(content) < 4:
        raise IdxFormatError(f"{path}: {len(content)} bytes, too short for an IDX header")
    zero, code, ndim = struct.unpack(">HBB", content[:4])
    if zero != 0:
        raise IdxFormatError(f"{path}: bad magic number 0x{content[:4].hex()} (an IDX file starts with "
                             f"0x0000)")
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise IdxFormatError(f"{path}: unknown IDX dtype code 0x{code:02X} (known: {known})")
    if ndim == 0:
        raise IdxFormatError(f"{path}: the header declares 0 dimensions")
    header_size = 4 + 4 * ndim
    if len(content) < header_size:
        raise IdxFormatError(f"{path}: the header declares {ndim} dimensions but the file ends inside it")
    shape = struct.unpack(f">{ndim}I", content[4:header_size])
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = len(content) - header_size
    if found != expected:
        raise IdxFormatError(
            f"{path}: payload is {found:,} bytes but the header's shape {shape} of {dtype} needs "
            f"{expected:,} (truncated or corrupted file)"
        )
    payload = np.frombuffer(content, dtype=dtype, offset=header_size).reshape(shape)
    return payload.astype(dtype.newbyteorder("="))


def _images_and_labels(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1:
        raise IdxFormatError(f"{images_path} / {labels_path}: expected images of shape (n, rows, cols) and "
                             f"labels of shape (n,), got {images.shape} and {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise IdxFormatError(f"{images_path} holds {images.shape[0]:,} images but {labels_path} holds "
                             f"{labels.shape[0]:,} labels")
    flat = images.reshape(images.shape[0], -1).astype(np.float32)
    if images.dtype == np.uint8:
        flat /= 255.0
    return flat, multiclass_labels(labels, lambda i: f"{labels_path}, label {i}")


def load_idx_image_dataset(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    """Registry loader: ``files`` are train images, train labels, test images, test labels.

    Images come back flattened, float32 in [0, 1]; labels int64. The published train/test split is kept.
    """
    del seed  # the split is the published one
    X_train, y_train = _images_and_labels(paths[0], paths[1])
    X_test, y_test = _images_and_labels(paths[2], paths[3])
    check_row_count(spec, paths[0], X_train.shape[0], spec.n_rows)
    check_row_count(spec, paths[2], X_test.shape[0], spec.n_test_rows or 0)
    return Dataset(spec.name, spec.task, X_train, y_train, X_test, y_test, np.arange(X_train.shape[0]),
                   X_train.shape[0] + np.arange(X_test.shape[0]), None)
