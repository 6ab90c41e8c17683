"""Parameter initialisation shared by both backends, so the same seed gives the same model.

Each parameter draws from a generator keyed by (seed, its canonical name): a pipeline stage
or tensor-parallel shard that builds only some parameters still gets identical values.
"""
from __future__ import annotations

import zlib

import numpy as np


def init_param(name: str, shape: tuple[int, ...], seed: int, std: float = 0.02) -> np.ndarray:
    """float32 array for parameter `name`: ones for norms, zeros for biases, N(0, std) elsewhere."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith(".bias"):
        return np.zeros(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
