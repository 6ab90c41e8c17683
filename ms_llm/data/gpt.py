"""GPT samples over an indexed dataset: megatron-core GPTDataset's three indices, in numpy.

The documents of a split are repeated for as many epochs as the requested samples need and
shuffled (the document index); read back to back they form one token stream, cut every
seq_len tokens into samples of seq_len + 1 (the sample index: where each sample starts, as
(position in the document index, token offset)); the samples are then visited in a shuffled
order (the shuffle index). Same seed, same inputs: the same three arrays as megatron-core
(numpy.random.RandomState, the same draws in the same order, its 80% rule for a short last
epoch), which tests/data/test_indexed_dataset.py checks against megatron-core itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_llm.data.indexed import IndexedDataset

FINAL_EPOCH_THRESHOLD = 0.80    # a last epoch this short is shuffled on its own (megatron-core)


@dataclass(frozen=True)
class GPTIndices:
    document: np.ndarray     # (epochs * documents,) int32 document ids
    sample: np.ndarray       # (samples + 1, 2) int64 (document-index position, token offset)
    shuffle: np.ndarray      # (samples,) sample order


def num_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_len: int) -> int:
    """Fewest epochs whose tokens give num_samples samples (each needs one token past its end)."""
    if num_samples is None:
        return 1
    return max(1, math.ceil((num_samples * seq_len + 1) / tokens_per_epoch))


def document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                   separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or epochs == 1:
        index = np.tile(documents.astype(np.int32), epochs)
        rng.shuffle(index)
        return index
    first = document_index(documents, epochs - 1, rng, False)
    return np.concatenate([first, document_index(documents, 1, rng, False)])


def sample_index(sizes: np.ndarray, doc_index: np.ndarray, seq_len: int, num_samples: int) -> np.ndarray:
    """Row i: where token i * seq_len of the stream lies. Zero-length documents are skipped, as
    megatron-core's helpers.cpp skips them."""
    ends = np.cumsum(sizes[doc_index], dtype=np.int64)            # stream position after each document
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    pos = np.searchsorted(ends, starts, side="right")             # first document ending past the start
    offset = starts - (ends[pos] - sizes[doc_index[pos]])
    return np.stack([pos.astype(np.int64), offset], axis=1)


def shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def epoch_plan(tokens: int, num_samples: Optional[int], seq_len: int) -> tuple[int, bool]:
    """(epochs, whether the last is shuffled apart): with the seed, all the indices depend on, so
    asking for more samples within the same plan extends nothing and reorders nothing."""
    epochs = num_epochs(tokens, num_samples, seq_len)
    if epochs == 1:
        return 1, False
    before_final = ((epochs - 1) * tokens - 1) // seq_len
    per_epoch = (tokens - 1) // seq_len
    return epochs, num_samples - before_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)


def build_indices(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: Optional[int],
                  seed: int) -> GPTIndices:
    """The indices for `num_samples` samples (None: one epoch) over `documents` (ids into sizes)."""
    tokens = int(sizes[documents].sum(dtype=np.int64))
    epochs, separate = epoch_plan(tokens, num_samples, seq_len)
    before_final = ((epochs - 1) * tokens - 1) // seq_len
    rng = np.random.RandomState(seed)
    doc = document_index(documents, epochs, rng, separate)
    total = (epochs * tokens - 1) // seq_len
    sample = sample_index(sizes, doc, seq_len, total)
    shuffle = shuffle_index(before_final if separate else total, total, rng)
    return GPTIndices(doc, sample, shuffle)


class GPTSamples:
    """Samples of seq_len + 1 tokens, in shuffled order, read from memory-mapped indices."""

    def __init__(self, dataset: IndexedDataset, indices: GPTIndices, seq_len: int):
        self.dataset, self.indices, self.seq_len = dataset, indices, seq_len

    def __len__(self) -> int:
        return int(self.indices.shuffle.size)

    def sample(self, i: int) -> np.ndarray:
        """(seq_len + 1,) int64: sample i of the shuffled order."""
        return self.rows(np.array([i]))[0]

    def rows(self, order: np.ndarray) -> np.ndarray:
        """(len(order), seq_len + 1) int64, gathered in one vectorized read: each sample is the
        pieces of the documents it spans, (start, offset) to (end, offset + 1) of the sample index."""
        ds, doc = self.dataset, self.indices.document
        s = np.asarray(self.indices.shuffle[np.asarray(order)], dtype=np.int64)
        first, last = self.indices.sample[s], self.indices.sample[s + 1]
        pieces = last[:, 0] - first[:, 0] + 1                                # documents each sample spans
        row = np.repeat(np.arange(s.size), pieces)
        pos = first[row, 0] + np.arange(row.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        seq = doc[pos]
        lo = np.where(pos == first[row, 0], first[row, 1], 0)
        hi = np.where(pos == last[row, 0], last[row, 1] + 1, ds.sizes[seq])  # + 1: the target of the last input
        lengths = hi - lo
        ends = np.cumsum(lengths)
        flat = np.repeat(ds.starts[seq] + lo - (ends - lengths), lengths) + np.arange(int(ends[-1]) if ends.size else 0)
        return ds.tokens[flat].astype(np.int64).reshape(s.size, self.seq_len + 1)
