"""ZeRO stages 0-3 written once: the partition (flat buffers, buckets, shard ownership),
the collective schedule, and the engine both backends run over a small protocol."""
from ms_llm.zero.plan import OwnedPiece, ZeroPlan, zero_plan, zero_plan_for_params

__all__ = ["OwnedPiece", "ZeroPlan", "zero_plan", "zero_plan_for_params"]
