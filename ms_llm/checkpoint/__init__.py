"""One sharded checkpoint format for both backends (numpy + stdlib + safetensors only).

A checkpoint is a folder of safetensors shard files (one per rank), one index part per rank
and index.json, the head (format.py, index_parts.py). Backends never touch files: they pair
local tensors with Pieces read off the ModelPlan and hand numpy over (torch:
`t.detach().cpu().numpy()`, MindSpore: `.asnumpy()`; see torch_backend/checkpoint.py and
ms_llm/mindspore/checkpoint.py).

In a trainer (both backends do this; the backend only supplies a TrainerState, see
torch_backend/state.py and ms_llm/mindspore/state.py):

    from ms_llm.checkpoint.trainer import TrainerCheckpoints
    checkpoints = TrainerCheckpoints(job, run, plan, state, sampler, rank, logger)
    for step in range(checkpoints.resume(), train.steps):     # memory tier, run folder or train.checkpoint.load
        step_time = train_one_step(step)                      # the backend's step
        checkpoints.after_step(step + 1, step_time)           # saves every `interval` (or 'auto') steps
    checkpoints.close()

Save by hand (every rank; returns after a host-memory snapshot, persists in the background):

    from ms_llm.checkpoint import CheckpointWriter, SaveItem, param_pieces, optim_pieces, run_config
    writer = CheckpointWriter(run_dir / "checkpoints", rank, world, session=run_id, keep_last=3,
                              memory=MemoryTier.for_job(run_id) if memory_tier else None)
    pieces = param_pieces(plan, rank) | optim_pieces(plan, rank, ("exp_avg", "exp_avg_sq"))
    stats = writer.save(step, [SaveItem(p, local[name]) for name, p in pieces.items()],
                        state={"step": step, "scheduler": ..., "sampler": ..., "loss_scale": ...},
                        rank_state={"rng": ...}, config=run_config(plan, "torch"))
    # stats.stall_s now; stats.total_s once writer.wait() / the next save returns
    writer.close()

Load, under any strategy and world size (each rank reads only the bytes its pieces need):

    folders = restore_folders(run_dir / "checkpoints", memory)   # memory tier first if newer
    ckpt, arrays = load_with_fallback(folders, lambda c: c.read_pieces(pieces), rank)   # rank: its parts first
    ckpt.step, ckpt.state, ckpt.rank_state(rank)

Pieces of ZeRO flat buffers map back to named tensors with `flat_pieces`. The interval
policy (train.checkpoint.interval: auto) is `choose_interval`. Exports and imports
(Hugging Face, MindSpore, torch DCP) and resharding: `ms-llm convert-checkpoint`.
"""
from ms_llm.checkpoint.boxes import Region
from ms_llm.checkpoint.format import optim_name, run_config, split_optim_name
from ms_llm.checkpoint.interval import IntervalInputs, choose_interval
from ms_llm.checkpoint.memory_tier import MemoryTier, restore_folders
from ms_llm.checkpoint.reader import Checkpoint, candidates, load_with_fallback
from ms_llm.checkpoint.shards import Piece, flat_pieces, layout_piece, optim_pieces, param_pieces
from ms_llm.checkpoint.writer import CheckpointWriter, SaveItem, SaveStats

__all__ = [
    "Checkpoint", "CheckpointWriter", "IntervalInputs", "MemoryTier", "Piece", "Region", "SaveItem",
    "SaveStats", "candidates", "choose_interval", "flat_pieces", "layout_piece", "load_with_fallback",
    "optim_name", "optim_pieces", "param_pieces", "restore_folders", "run_config",
    "split_optim_name",
]
