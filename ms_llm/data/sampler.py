"""Global-batch sampler: the batch at step k is the same whatever the dp size or strategy.

Samples are non-overlapping windows of seq_len + 1 tokens. Each epoch visits them in a
permutation seeded by (seed, epoch). Step k takes the next global_batch samples of that
order; data-parallel rank r of D takes rows [r*G/D, (r+1)*G/D) of it. The state is
(seed, epoch, position), so resuming at step k, on any world size, continues exactly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ms_llm.errors import ConfigError


@dataclass(frozen=True)
class SamplerState:
    seed: int
    epoch: int
    position: int          # samples of this epoch already consumed

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplerState":
        return cls(int(d["seed"]), int(d["epoch"]), int(d["position"]))


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
        per_epoch = self.num_samples // self.global_batch * self.global_batch
        return (state.epoch * per_epoch + state.position) // self.global_batch

    def global_indices(self, step: int) -> np.ndarray:
        st = self.state_at(step)
        return self._epoch_order(st.epoch)[st.position:st.position + self.global_batch]

    def local_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        """(global_batch / dp_size, seq_len + 1) int64 tokens of this rank at `step`."""
        if self.global_batch % dp_size:
            raise ConfigError(f"train.global_batch_size: {self.global_batch} is not divisible by dp={dp_size}")
        per_rank = self.global_batch // dp_size
        idx = self.global_indices(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        starts = idx * self.seq_len
        rows = [np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return np.stack(rows)
