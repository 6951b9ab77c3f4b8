"""The bundled MNIST subset (data/mnist-subset: 10,000 training and 2,000 test images, gzip
IDX files) read with numpy and gzip alone: no download, no torchvision. Shared by the
examples in this folder."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path
from typing import Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "mnist-subset"

#: The training set's pixel mean and standard deviation (of the full MNIST training set).
MEAN, STD = 0.1307, 0.3081


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (gzip or plain): a big-endian header (magic: 0, 0, type 0x08 = u8,
    number of dimensions; then each dimension as a u32) and the raw bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {data.size} bytes")
    return data.reshape(dims)


def load(split: str, data_dir: Path = DATA) -> Tuple[np.ndarray, np.ndarray]:
    """``split`` is "train" or "t10k": images as float32 (N, 1, 28, 28), normalised, and
    labels as int64 (N,)."""
    images = read_idx(data_dir / f"{split}-images-idx3-ubyte.gz")
    labels = read_idx(data_dir / f"{split}-labels-idx1-ubyte.gz")
    if len(images) != len(labels):
        raise ValueError(f"{split}: {len(images)} images but {len(labels)} labels")
    x = (images.astype(np.float32) / 255.0 - MEAN) / STD
    return x[:, None, :, :], labels.astype(np.int64)


def import_elasticps():
    """``import elasticps``, falling back to this repository's ``python/`` folder (with
    the native module built and copied in) when the package is not installed."""
    try:
        import elasticps
    except ImportError:
        sys.path.insert(0, str(REPO / "python"))
        import elasticps
    return elasticps
