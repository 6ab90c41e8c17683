"""A peer's whole training state under ms_llm names, read lazily: what `ms-llm import-run` writes
and what `ms-llm export-run` hands a peer's writer.

Each peer reader (Megatron-LM, DeepSpeed, torchtitan, MindFormers) maps its files to one
ForeignRun: the model weights under canonical (Hugging Face) names, the Adam moments under
optim_name("exp_avg" | "exp_avg_sq", name), fp32 master weights under optim_name("master", name)
where the peer keeps them apart from bf16/fp16 weights, and the training state a checkpoint head
holds (ms_llm/run/saved_state.py: optimizer_step, lr, loss_scale, sampler). A tensor is read only
when the writer asks for it, so a conversion holds one tensor (and its pieces) at a time.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.checkpoint.storage.boxes import Region
from ms_llm.checkpoint.storage.checksum import DEFAULT as CHECKSUM, block_checksums
from ms_llm.checkpoint.storage.commit import commit, step_dir, tmp_dir, write_fragment
from ms_llm.checkpoint.storage.format import ShardEntry, encode_state, rank_file, run_config, split_optim_name
from ms_llm.checkpoint.storage.index_parts import encode_part
from ms_llm.checkpoint.storage.safetensors_io import header_bytes, storage_dtype, write_file
from ms_llm.checkpoint.storage.untrusted import confined
from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError
from ms_llm.strategy.ir import ParallelStrategy

BLOCK_BYTES = 4 << 20                                   # checksum block, as CheckpointWriter's default
FILE_METADATA = {"format": "pt", "writer": "ms_llm"}


@dataclass(frozen=True)
class LazyTensor:
    """One whole tensor of a foreign checkpoint: its shape and ms_llm dtype name ("float32",
    "bfloat16" as raw uint16 bits, "float16"), and how to read it when it is needed."""
    shape: tuple[int, ...]
    dtype: str
    read: Callable[[], np.ndarray]


@dataclass
class ForeignRun:
    """A peer's training state at `step`, ready to be written as an ms_llm checkpoint."""
    source: str                              # "megatron", "deepspeed", "torchtitan", "mindformers"
    model: ModelConfig
    step: int
    tensors: dict[str, LazyTensor]
    state: dict[str, Any] = field(default_factory=dict)     # the checkpoint head's training state
    job: Optional[dict[str, Any]] = None     # the ms_llm job document converted from the peer's config
    notes: list[str] = field(default_factory=list)          # what the import could not carry, said to the user


def write_foreign_run(run: ForeignRun, dst_root: str | Path, *, overwrite: bool = False) -> Path:
    """Write `run` as a one-rank ms_llm checkpoint of step run.step under `dst_root` (the training
    state in its head, so a resume sets the optimizer step, loss scale and data position from it);
    returns the step folder. The shard file is streamed: each LazyTensor is read, checksummed and
    written before the next is read, so the peak is one tensor (and what its read() assembles it
    from), never the model: CheckpointWriter's host-buffer snapshot is for training, not this."""
    dst_root = Path(dst_root)
    final = step_dir(dst_root, run.step)
    if final.exists() and not overwrite:
        raise CheckpointError(f"{dst_root}: already holds step {run.step} ({final}); pass --overwrite to replace it, "
                              "or write to another folder")
    target = layout_plan(run.model, ParallelStrategy(dp=1), 1)
    _check_names(run, target)
    state = dict(run.state)
    if state.setdefault("step", run.step) != run.step:
        raise CheckpointError(f"{run.source} checkpoint: its training state says step {state['step']!r} but the "
                              f"checkpoint is of step {run.step}")
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in run.tensors.items()]
    order = sorted(entries, key=lambda e: -storage_dtype(e[1]).itemsize)     # as write_file lays them out
    _, spans = header_bytes(order, FILE_METADATA)
    folder = tmp_dir(dst_root, run.step)
    shutil.rmtree(folder, ignore_errors=True)          # left by an import that was interrupted
    folder.mkdir(parents=True)
    sums: dict[str, list[int]] = {}

    def fetch(name: str) -> np.ndarray:
        tensor = run.tensors[name]
        array = np.ascontiguousarray(tensor.read())
        if array.dtype != storage_dtype(tensor.dtype) or tuple(array.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{run.source} checkpoint: tensor {name!r} read as {array.dtype} "
                                  f"{tuple(array.shape)}, but its header says {tensor.dtype} {tuple(tensor.shape)}")
        sums[name] = block_checksums(memoryview(array).cast("B"), BLOCK_BYTES)
        return array

    try:
        write_file(str(confined(dst_root, f"{folder.name}/{rank_file(0)}", "a shard file")), entries, fetch,
                   FILE_METADATA)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)      # nothing half-written left behind
        raise
    shards, tensors, elements = {}, {}, {}
    for span in spans:
        region = Region((0,) * len(span.shape), span.shape)
        shards[span.key] = [ShardEntry(rank_file(0), span.key, region, BLOCK_BYTES, tuple(sums[span.key]), CHECKSUM,
                                       span.start).to_json()]
        tensors[span.key] = {"shape": list(span.shape), "dtype": span.dtype, "layout": ""}
        elements[span.key] = region.numel
    session = f"import-{run.source}-{run.step}"
    fragment = {"rank": 0, "session": session, "file": rank_file(0), "state": encode_state(state), "rank_state": {},
                "config": run_config(target, run.source), "held": [], "tensors": tensors, "elements": elements,
                "cuts": {name: [] for name in tensors}}
    write_fragment(folder, 0, fragment, encode_part(0, run.step, shards))
    return commit(dst_root, run.step, 1, session)


def _check_names(run: ForeignRun, target) -> None:
    """Every weight of the model present, every tensor one the model has (or a state of one), in
    its shape: a reader's naming slip or another model's optimizer state is one line here rather
    than a resume that fails later."""
    known = {n: p.shape for n, p in target.params.items()} | {n: b.shape for n, b in target.buffers.items()}
    for name, tensor in run.tensors.items():
        owned = split_optim_name(name)
        param = owned[1] if owned else name
        if param not in known or (owned and param not in target.params):
            raise CheckpointError(f"{run.source} checkpoint: tensor {name!r} is not a weight of the model "
                                  f"({run.model.name or 'its config'}) nor an optimizer state of one")
        if tuple(tensor.shape) != tuple(known[param]):
            raise CheckpointError(f"{run.source} checkpoint: tensor {name!r} has shape {list(tensor.shape)} but the "
                                  f"model's {param} is {list(known[param])}; the state of a different model?")
    missing = [n for n in target.params if n not in run.tensors]
    if missing:
        raise CheckpointError(f"{run.source} checkpoint: lacks weight {missing[0]!r}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
