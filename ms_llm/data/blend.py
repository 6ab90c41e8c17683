"""Splits and blends with Megatron's semantics.

Split: each dataset's documents are cut into contiguous train / valid / test ranges by the
normalized shares, beg = round(lo * documents), end = round(hi * documents), as megatron-core's
BlendedMegatronDatasetBuilder cuts them.

Blend: normalized weights; dataset d supplies its share of the blend's samples, and sample i
of the blend comes from the dataset furthest behind its share. megatron-core picks that greedily
in C++, one sample at a time; here every dataset's k-th sample is placed at time (k + 1/2) / w_d
and the times are merged in one vectorized sort: after any i samples each dataset has supplied
w_d * i samples to within two (megatron-core: within one), at numpy speed.
"""
from __future__ import annotations

import numpy as np


def split_bounds(fractions: tuple[float, float, float], documents: int) -> list[tuple[int, int]]:
    """(begin, end) document range per split; an empty share gives an empty range."""
    edges = [0.0]
    for f in fractions:
        edges.append(edges[-1] + f)
    bounds = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        beg, end = int(round(lo * float(documents))), int(round(hi * float(documents)))
        bounds.append((beg, end) if hi > lo else (beg, beg))
    return bounds


def normalize(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def blend_order(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample int16, its sample number within that dataset int64)."""
    ids, ks, times = [np.zeros(0, np.int16)], [np.zeros(0, np.int64)], [np.zeros(0)]
    for d, w in enumerate(weights):
        if w <= 0:
            continue
        # enough candidates that none of the first `size` merged times is missing
        k = np.arange(int(np.ceil(w * size)) + len(weights) + 2, dtype=np.int64)
        ids.append(np.full(k.size, d, dtype=np.int16))
        ks.append(k)
        times.append((k + 0.5) / w)
    ids_all, ks_all, times_all = np.concatenate(ids), np.concatenate(ks), np.concatenate(times)
    order = np.lexsort((ids_all, times_all))[:size]            # by time, ties to the lower dataset
    return ids_all[order], ks_all[order]
