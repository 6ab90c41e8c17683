"""Global-batch sampler: the batch at step k is the same whatever the dp size or strategy.

Samples are non-overlapping windows of seq_len + 1 tokens. Each epoch visits them in a
permutation seeded by (seed, epoch). Step k takes the next global_batch samples of that
order; data-parallel rank r of D takes rows [r*G/D, (r+1)*G/D) of it. The state is
(seed, epoch, position), so resuming at step k, on any world size, continues exactly.

IndexedBatchSampler serves the same interface over indexed datasets, whose order (blend,
Megatron's shuffled epochs) is fixed in advance for the run's steps: step k takes samples
[k*G, (k+1)*G) of it. ValidBatches hands out the first n global batches of the valid split.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from ms_llm.errors import ConfigError


@dataclass(frozen=True)
class SamplerState:
    seed: int
    epoch: int
    position: int          # samples of this epoch already consumed
    index: str = ""        # indexed data: the identity of the sample order (data + settings)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplerState":
        return cls(int(d["seed"]), int(d["epoch"]), int(d["position"]), str(d.get("index", "")))


class BatchSampler(Protocol):
    """What the loop and the checkpoints use: the global batch of a step, cut by dp rank."""
    global_batch: int

    def state_at(self, step: int) -> SamplerState: ...

    def step_of(self, state: SamplerState) -> int: ...

    def local_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray: ...


class SampleOrder(Protocol):
    """A split's samples in their fixed order (ms_llm.data.samples.BlendedSamples)."""
    order: str             # identity of the order, whatever its length

    def __len__(self) -> int: ...

    def rows(self, order: np.ndarray) -> np.ndarray: ...


def rank_rows(global_batch: int, dp_rank: int, dp_size: int) -> slice:
    """Rows [r*G/D, (r+1)*G/D) of a global batch belong to dp rank r of D."""
    if global_batch % dp_size:
        raise ConfigError(f"train.global_batch_size: {global_batch} is not divisible by dp={dp_size}")
    per_rank = global_batch // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


class GlobalBatchSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < global_batch:
            raise ConfigError(f"train.data.source: {len(tokens)} tokens give {self.num_samples} sequences of "
                              f"{seq_len}, fewer than one global batch ({global_batch}); use more data or "
                              "a smaller batch / seq_len")
        self._order_epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def state_at(self, step: int) -> SamplerState:
        """Where the stream stands before `step` (each step consumes global_batch samples)."""
        per_epoch = self.num_samples // self.global_batch * self.global_batch   # drop the ragged tail
        epoch, position = divmod(step * self.global_batch, per_epoch)
        return SamplerState(self.seed, epoch, position)

    def step_of(self, state: SamplerState) -> int:
        if state.seed != self.seed:
            raise ConfigError(f"train.seed: checkpoint data order used seed {state.seed}, this run {self.seed}; "
                              "keep the seed to follow the same data order")
        if state.index:
            raise ConfigError(f"train.data: the checkpoint read indexed datasets (order {state.index}), this run a "
                              "token file; give the same train.data.paths to resume")
        per_epoch = self.num_samples // self.global_batch * self.global_batch
        return (state.epoch * per_epoch + state.position) // self.global_batch

    def global_indices(self, step: int) -> np.ndarray:
        st = self.state_at(step)
        return self._epoch_order(st.epoch)[st.position:st.position + self.global_batch]

    def local_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        """(global_batch / dp_size, seq_len + 1) int64 tokens of this rank at `step`."""
        idx = self.global_indices(step)[rank_rows(self.global_batch, dp_rank, dp_size)]
        starts = idx * self.seq_len
        rows = [np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return np.stack(rows)


class IndexedBatchSampler:
    """Step k is samples [k*G, (k+1)*G) of a fixed order; the state records which order."""

    def __init__(self, samples: SampleOrder, global_batch: int, seed: int):
        self.samples, self.global_batch, self.seed = samples, global_batch, seed

    def state_at(self, step: int) -> SamplerState:
        return SamplerState(self.seed, 0, step * self.global_batch, self.samples.order)

    def step_of(self, state: SamplerState) -> int:
        if state.index != self.samples.order:
            raise ConfigError(f"train.data: the checkpoint's data order ({state.index or 'a token file'}) is not this "
                              f"run's ({self.samples.order}); the data files, seq_len, seed, split or weights "
                              "changed since it was saved, or the new steps need more epochs: keep them to resume "
                              "sample-exact")
        return state.position // self.global_batch

    def global_indices(self, step: int) -> np.ndarray:
        lo = step * self.global_batch
        if lo + self.global_batch > len(self.samples):
            raise ConfigError(f"train.steps: step {step} is past the {len(self.samples)} samples the data order was "
                              "built for; the launcher builds it for train.steps")
        return np.arange(lo, lo + self.global_batch)

    def local_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        """(global_batch / dp_size, seq_len + 1) int64 tokens of this rank at `step`."""
        return self.samples.rows(self.global_indices(step)[rank_rows(self.global_batch, dp_rank, dp_size)])


class ValidBatches:
    """The valid split's first global batches: fixed, the same on every rank and every call."""

    def __init__(self, samples: SampleOrder, global_batch: int):
        self.samples, self.global_batch = samples, global_batch

    def available(self) -> int:
        return len(self.samples) // self.global_batch

    def batches(self, n: int) -> list[np.ndarray]:
        """n arrays (global_batch, seq_len + 1) int64."""
        if n > self.available():
            raise ConfigError(f"train.eval.batches: {n} batches of {self.global_batch} need {n * self.global_batch} "
                              f"validation samples, the valid split has {len(self.samples)}; ask for at most "
                              f"{self.available()} or give the valid split a larger share (train.data.split)")
        g = self.global_batch
        return [self.samples.rows(np.arange(i * g, (i + 1) * g)) for i in range(n)]
