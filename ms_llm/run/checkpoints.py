"""Checkpointing inside a training loop, written once for both backends.

    checkpoints = TrainerCheckpoints(job, run, plan, state, sampler, rank, logger, loss_scale)
    for step in range(checkpoints.resume(), train.steps):
        ...forward and backward...
        checkpoints.fence()          # before the optimizer writes: the last save's snapshot is taken
        ...the optimizer's update...
        checkpoints.after_step(step + 1, step_time)
    checkpoints.close()

With train.checkpoint.async_save the snapshot's copies run beside the next forward and
backward, which only read the training state, so a save stalls training only for what the
fence still has to wait for.

`state` is the backend's TrainerState: it lists the tensors of its training state with
the Piece of the global tensor each holds, converts them, and runs the two tiny collectives
the policy needs. Everything else (where to resume from, the cadence or the 'auto'
interval, the training-state record, metrics) lives here.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from ms_llm.checkpoint.reader import Checkpoint, candidates
from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.storage.format import INDEX, optim_name, run_config
from ms_llm.checkpoint.writer import CheckpointWriter, SaveItem, SaveStats
from ms_llm.data.sampler import SamplerState
from ms_llm.errors import CheckpointError
from ms_llm.run.folder import RunFolder
from ms_llm.run.interval import IntervalInputs, choose_interval
from ms_llm.run.loss_scale import LossScaler
from ms_llm.run.lr import lr_at
from ms_llm.run.memory_tier import MemoryTier, restore_folders
from ms_llm.run.metrics import MetricsLogger
from ms_llm.run.saved_state import check_saved_state

log = logging.getLogger(__name__)

Held = dict[str, tuple[Piece, Any]]       # checkpoint name -> (piece, the backend's tensor)


class TrainerState(Protocol):
    backend: str

    def held(self, create: bool) -> Held:
        """Every tensor of this rank's training state; `create` makes optimizer states that
        exist only after a first step, so a load can fill them."""

    def save_items(self, pieces: dict[str, Piece], tensors: dict[str, Any]) -> list[SaveItem]:
        """The backend adapter's save_items (torch_backend / ms_llm.mindspore checkpoint.py)."""

    def load_into(self, ckpt: Checkpoint, pieces: dict[str, Piece], tensors: dict[str, Any],
                  strict: bool = True) -> list[str]:
        """The backend adapter's load_into: fill the tensors from `ckpt`, return the names."""

    def max_over_ranks(self, values: list[float]) -> list[float]: ...

    def session_token(self) -> str:
        """Equal on all ranks of this launch, new for every launch."""

    def set_optimizer_step(self, steps: int) -> None: ...

    def rank_state(self) -> dict:
        """This rank's own state (RNG), bytes allowed."""

    def set_rank_state(self, state: dict) -> None: ...


def master_of(name: str) -> Optional[str]:
    """The weight an optim.master.<weight> tensor copies, None for other names."""
    prefix = optim_name("master", "")
    return name[len(prefix):] if name.startswith(prefix) else None


class TrainerCheckpoints:
    def __init__(self, job, run: RunFolder, plan, state: TrainerState, sampler, rank: int, logger: MetricsLogger,
                 loss_scale: Optional[LossScaler] = None):
        self.job, self.run, self.plan, self.state, self.sampler, self.rank = job, run, plan, state, sampler, rank
        self.loss_scale = loss_scale
        self.cfg, self.logger = job.train.checkpoint, logger
        self.memory = None
        if self.cfg.memory_tier:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
            self.memory = MemoryTier.for_run(job.name, run.root, local_world_size=local)
        self.writer: Optional[CheckpointWriter] = None
        self.interval = self.cfg.interval if isinstance(self.cfg.interval, int) else None
        self.step_times: list[float] = []
        self.last_step: Optional[int] = None        # newest checkpoint saved or resumed from
        self.restore_s: Optional[float] = None      # seconds this rank's resume spent loading
        self._unfenced: Optional[SaveStats] = None  # a save whose snapshot may still be copying
        # Steps before the resumed checkpoint that did not update the optimizer and that no loss
        # scaler counts (an imported run's skipped iterations): later saves keep them out of
        # optimizer_step, so every resume applies Adam's bias correction of the updates made.
        self.steps_without_update = 0

    # ---- resume --------------------------------------------------------------------------
    def _folders(self) -> list[Path]:
        """The run's own checkpoints come first: a restarted run continues from its newest,
        even when it was started from train.checkpoint.load."""
        own = restore_folders(self.run.checkpoints, self.memory)
        if own or not self.cfg.load:
            return own
        path = Path(self.cfg.load)
        return [path] if (path / INDEX).is_file() else candidates(path)

    def resume(self) -> int:
        """Load the newest usable checkpoint (the memory tier when it is newest, the previous
        one when the newest is damaged); return the step to continue from, 0 for none."""
        if self.rank == 0:
            self._remove_partial()
        folders = self._folders()
        if not folders:
            if self.cfg.load:
                raise CheckpointError(f"train.checkpoint.load: {self.cfg.load} holds no committed checkpoint")
            return 0
        held = self.state.held(create=True)
        weights = [n for n in held if n in self.plan.params]

        def load(ckpt: Checkpoint) -> list[str]:
            self._check_state(ckpt)
            missing = [n for n in weights if n not in ckpt.index.tensors]
            if missing:
                raise CheckpointError(f"{ckpt.folder}: lacks weight {missing[0]!r}; a different model?")
            loaded = self._load(ckpt, held)
            # fp32 master weights the checkpoint lacks (it kept none) start from the weights.
            masters = {w: n for n in held if n not in ckpt.index.tensors and (w := master_of(n))}
            renamed = {w: (dataclasses.replace(held[n][0], name=w), held[n][1]) for w, n in masters.items()}
            return loaded + self._load(ckpt, renamed)

        ckpt = self._load_agreed(folders, load)
        saved = ckpt.state
        optimizer_step = int(saved.get("optimizer_step", ckpt.step))
        self.state.set_optimizer_step(optimizer_step)
        if self.loss_scale is not None:
            self.loss_scale.load_state(saved.get("loss_scale"))
        skipped = self.loss_scale.skipped if self.loss_scale else 0
        self.steps_without_update = ckpt.step - optimizer_step - skipped
        own = ckpt.rank_state(self.rank)
        if own and ckpt.index.world_size == self.plan.world_size:
            self.state.set_rank_state(own)
        if self.rank == 0:
            print(f"resumed from {ckpt.folder} (step {ckpt.step}, saved by {ckpt.config.get('backend', '?')} on "
                  f"{ckpt.index.world_size} rank(s)): {ckpt.bytes_loaded / 1e6:.1f} MB loaded in {self.restore_s:.2f} s",
                  flush=True)
        self.logger.event(resumed_from=str(ckpt.folder), resumed_step=ckpt.step, load_s=self.restore_s,
                          load_bytes=ckpt.bytes_loaded)
        self.last_step = ckpt.step
        ckpt.close()
        return ckpt.step

    def _remove_partial(self) -> None:
        """Temporary folders of saves a failure interrupted: nothing names them, nothing will finish them
        (every rank is here, none is saving), and on a full disk they hold the space the next save needs."""
        for folder in self.run.checkpoints.glob("step_*.tmp"):
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("removed %s, left by an interrupted save", folder)

    def _check_state(self, ckpt: Checkpoint) -> None:
        """The training-state record is untrusted input too: a field a resume could not use
        (saved_state.py) is a CheckpointError, so the previous checkpoint is tried."""
        saved = ckpt.state
        check_saved_state(saved, ckpt.rank_states(), ckpt.step, str(ckpt.folder / INDEX))
        try:
            position = (self.sampler.step_of(SamplerState.from_dict(saved["sampler"])) if saved.get("sampler")
                        else ckpt.step)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{ckpt.folder}: training state is malformed ({type(exc).__name__}: {exc})") from None
        if position != ckpt.step:
            raise CheckpointError(f"{ckpt.folder}: data position does not match step {ckpt.step}; train.seed or "
                                  "global_batch_size changed since it was saved")

    def _load_agreed(self, folders: list[Path], load: Callable[[Checkpoint], object]) -> Checkpoint:
        """load_with_fallback for many ranks: after each folder the ranks compare, so a file
        damaged for some ranks only sends all of them back to the previous checkpoint."""
        most, least = self.state.max_over_ranks([len(folders), -len(folders)])
        if most != -least:
            raise CheckpointError(f"ranks see {-least:.0f} to {most:.0f} checkpoints to resume from; every rank "
                                  "needs the same run folder (and train.checkpoint.load)")
        failures = []
        self.restore_s = 0.0
        for folder in folders:
            started = time.perf_counter()
            try:
                ckpt = Checkpoint(folder, rank=self.rank)
                load(ckpt)
            except CheckpointError as exc:
                log.warning("checkpoint %s unusable, trying the previous one: %s", folder, exc)
                failures.append(f"  - {exc}")
                ckpt = None
            self.restore_s += time.perf_counter() - started     # this rank's reading; not the others' pace
            if self.state.max_over_ranks([float(ckpt is None)])[0]:
                if ckpt is not None:
                    ckpt.close()
                continue
            newest, oldest = self.state.max_over_ranks([ckpt.step, -ckpt.step])
            if newest != -oldest:
                raise CheckpointError(f"ranks loaded different steps ({-oldest:.0f} .. {newest:.0f}) from {folder}")
            return ckpt
        here = "\n".join(failures) or "  - (the failures were on other ranks)"
        raise CheckpointError("no checkpoint loads on every rank:\n" + here)

    def _load(self, ckpt: Checkpoint, held: Held) -> list[str]:
        return self.state.load_into(ckpt, {n: p for n, (p, _) in held.items()}, {n: t for n, (_, t) in held.items()},
                                    strict=False)

    # ---- save ----------------------------------------------------------------------------
    def after_step(self, step: int, step_time: float) -> None:
        """Called with the number of completed steps; saves on the cadence."""
        self.step_times.append(step_time)
        if self.cfg.interval == 0:
            return
        if self.interval is None:           # 'auto': save once to measure, then decide
            if self.writer is None:
                self.save(step)
            elif self.writer.last is not None and self.writer.last.step < step:
                self._decide()
            return
        if step % self.interval == 0 or step == self.plan.train.steps:
            self.save(step)

    def _decide(self) -> None:
        self.fence()
        last = self.writer.wait()
        times = sorted(self.step_times)
        # A run that resumed measured its restore; one that did not takes a save's time for it.
        restore = last.total_s if self.restore_s is None else self.restore_s
        stall, total, iter_s, restore = self.state.max_over_ranks(
            [last.stall_s, last.total_s, times[len(times) // 2], restore])
        decision = choose_interval(IntervalInputs(stall, total, iter_s, restore, self.cfg.mtbf_hours))
        self.interval = decision.steps                    # every rank computed the same
        if self.rank == 0:
            print(decision.report(), flush=True)
        self.logger.event(checkpoint_interval=decision.steps, wasted_s_per_hour=decision.wasted_s_per_hour)

    def save(self, step: int) -> None:
        if self.writer is None:
            self.writer = CheckpointWriter(self.run.checkpoints, self.rank, self.plan.world_size,
                                           session=self.state.session_token(), keep_last=self.cfg.keep_last,
                                           memory=self.memory)
        held = self.state.held(create=False)
        items = self.state.save_items({n: p for n, (p, _) in held.items()}, {n: t for n, (_, t) in held.items()})
        scaler = self.loss_scale
        record = {"step": step, "optimizer_step": step - (scaler.skipped if scaler else 0) - self.steps_without_update,
                  "lr": lr_at(step, self.plan.train), "sampler": self.sampler.state_at(step).to_dict(),
                  "loss_scale": scaler.state() if scaler else None}
        previous = self.writer.last
        self.last_step = step
        self._unfenced = self.writer.save(step, items, state=record, rank_state=self.state.rank_state(),
                                          config=run_config(self.plan, self.state.backend),
                                          overlap=self.cfg.async_save)         # waits for `previous` first
        self._report_durable(previous)
        if not self.cfg.async_save:
            self.fence()
            self.writer.wait()

    def fence(self) -> None:
        """Called before the optimizer changes the training state: waits until the last save's
        snapshot is taken, then logs what that save stalled training."""
        if self._unfenced is None:
            return
        stats, self._unfenced = self._unfenced, None
        self.writer.fence()
        self.logger.event(checkpoint_step=stats.step, stall_s=stats.stall_s, wait_s=stats.wait_s, bytes=stats.bytes)

    def _report_durable(self, stats: Optional[SaveStats]) -> None:
        if stats is not None:
            self.logger.event(checkpoint_step=stats.step, total_s=stats.total_s, persist_s=stats.persist_s)

    def close(self) -> None:
        self.fence()
        if self.writer is not None:
            self._report_durable(self.writer.wait())
            self.writer.close()
