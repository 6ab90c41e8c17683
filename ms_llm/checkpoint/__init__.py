"""One sharded checkpoint format for both backends (numpy + stdlib + safetensors only).

This package is a library: it imports nothing from the training run (ms_llm/run uses it).
    checkpoint/            the API: Checkpoint (reader.py), CheckpointWriter (writer.py), Pieces
                           (shards.py), offline resharding (reshard.py), ZeRO flat buffers (zero_state.py)
    checkpoint/storage/    the engine: format, index parts, safetensors I/O, transfer, commit, checks
    checkpoint/interop/    other frameworks' checkpoints (Hugging Face, MindSpore and Megatron names)

A checkpoint is a folder of safetensors shard files (one per rank), one index part per rank
and index.json, the head (format.py, index_parts.py). Backends never touch files: they pair
local tensors with Pieces read off the ModelPlan and hand numpy over (torch:
`t.detach().cpu().numpy()`, MindSpore: `.asnumpy()`; see torch_backend/checkpoint.py and
ms_llm/mindspore/checkpoint.py).

In a trainer (both backends do this; the backend only supplies a TrainerState, see
torch_backend/state.py and ms_llm/mindspore/state.py):

    from ms_llm.run.checkpoints import TrainerCheckpoints
    checkpoints = TrainerCheckpoints(job, run, plan, state, sampler, rank, logger)
    for step in range(checkpoints.resume(), train.steps):     # memory tier, run folder or train.checkpoint.load
        step_time = train_one_step(step)                      # the backend's step
        checkpoints.after_step(step + 1, step_time)           # saves every `interval` (or 'auto') steps
    checkpoints.close()

Save by hand (every rank; returns after a host-memory snapshot, persists in the background):

    from ms_llm.checkpoint import CheckpointWriter, SaveItem, param_pieces, optim_pieces, run_config
    writer = CheckpointWriter(run_dir / "checkpoints", rank, world, session=run_id, keep_last=3,
                              memory=None)      # or run.memory_tier.MemoryTier.for_job(run_id)
    pieces = param_pieces(plan, rank) | optim_pieces(plan, rank, ("exp_avg", "exp_avg_sq"))
    stats = writer.save(step, [SaveItem(p, local[name]) for name, p in pieces.items()],
                        state={"step": step, "scheduler": ..., "sampler": ..., "loss_scale": ...},
                        rank_state={"rng": ...}, config=run_config(plan, "torch"))
    # stats.stall_s now; stats.total_s once writer.wait() / the next save returns
    writer.close()

Load, under any strategy and world size (each rank reads only the bytes its pieces need):

    folders = candidates(run_dir / "checkpoints")     # newest first; run.memory_tier.restore_folders adds memory
    ckpt, arrays = load_with_fallback(folders, lambda c: c.read_pieces(pieces), rank)   # rank: its parts first
    ckpt.step, ckpt.state, ckpt.rank_state(rank)

Pieces of ZeRO flat buffers map back to named tensors with `flat_pieces`. The interval
policy (train.checkpoint.interval: auto) is ms_llm/run/interval.py. Exports and imports
(Hugging Face, MindSpore, torch DCP) and resharding: `ms-llm convert-checkpoint`.
"""
from ms_llm.checkpoint.reader import Checkpoint, candidates, load_with_fallback
from ms_llm.checkpoint.shards import Piece, flat_pieces, layout_piece, optim_pieces, param_pieces
from ms_llm.checkpoint.storage.boxes import Region
from ms_llm.checkpoint.storage.format import optim_name, run_config, split_optim_name
from ms_llm.checkpoint.writer import CheckpointWriter, SaveItem, SaveStats

__all__ = [
    "Checkpoint", "CheckpointWriter", "Piece", "Region", "SaveItem", "SaveStats", "candidates", "flat_pieces",
    "layout_piece", "load_with_fallback", "optim_name", "optim_pieces", "param_pieces", "run_config",
    "split_optim_name",
]
