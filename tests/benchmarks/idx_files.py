"""Fashion-MNIST-shaped idx files written here: the real data are a Debian package that CI need not have."""
import gzip
import struct

import numpy as np
import pytest


def write_idx(path, array):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def data_dir(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 5300), ("t10k", 200)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        images[np.arange(n), labels * 2 + 4, 4:24] = 255  # a bright row whose place gives the class
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return str(tmp_path)
