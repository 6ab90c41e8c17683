"""The shared ZeRO engine's training state as checkpoint pieces, for either backend.

The engine (ms_llm.zero) keeps, per bucket, flat segments: Adam moments m and v, an fp32
master copy, and under ZeRO-3 the parameter shard. Its ZeroPlan says which box of which
parameter each run of a segment holds (OwnedPiece). This maps every such run to its
checkpoint name and Piece; a backend only slices its own tensor type.
"""
from __future__ import annotations

from dataclasses import dataclass

from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.storage.boxes import Region
from ms_llm.checkpoint.storage.format import optim_name

# Bucket-state attribute -> optimizer-state name in checkpoints (torch.optim.AdamW's names).
STATES = {"m": "exp_avg", "v": "exp_avg_sq", "master": "master"}


@dataclass(frozen=True)
class EngineSlice:
    """Elements [start, start + numel) of bucket `bucket`'s `attr` segment hold `piece`."""
    piece: Piece
    bucket: int
    attr: str                      # "m", "v", "master" or "param_shard"
    start: int
    numel: int


def engine_slices(engine, plan, rank: int) -> dict[str, EngineSlice]:
    """Checkpoint name -> where the engine on `rank` keeps it."""
    zplan, out = engine.zplan, {}
    for b in engine.buckets:
        st = engine.state[b.index]
        base = b.start + zplan.segment_index(rank, b) * b.segment
        for owned in zplan.pieces(rank, b):
            shape = plan.params[owned.name].shape
            region = Region(*owned.global_box)
            start = owned.start - base
            for attr, state in STATES.items():
                if getattr(st, attr) is not None:
                    name = optim_name(state, owned.name)
                    out[name] = EngineSlice(Piece(name, shape, region, owned.primary), b.index, attr, start,
                                            owned.numel)
            if st.param_shard is not None:
                out[owned.name] = EngineSlice(Piece(owned.name, shape, region, owned.primary), b.index,
                                              "param_shard", start, owned.numel)
    return out
