"""The model, data and optimizer settings the ZeRO engine tests share across backends
(numpy only, so both torch and MindSpore workers import it)."""
from __future__ import annotations

import dataclasses

import numpy as np

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.config.train import OptimizerConfig, TrainConfig
from ms_llm.strategy.ir import OffloadSpec, ParallelStrategy, PrecisionSpec, ZeroSpec

MODEL = ModelConfig(name="zero-test", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=128, max_seq_len=32, dtype="float32")
# The same with 4 routed experts per layer (a case ending in ':moe'): dropless, no load-balancing loss,
# so nothing depends on how the tokens split over ranks; ZeRO over edp = dp shards the experts.
MOE_MODEL = dataclasses.replace(MODEL, name="zero-test-moe", moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.0))
GLOBAL_BATCH, SEQ, STEPS, MICRO = 8, 16, 2, 2
LR = {"sgd": 0.5, "adamw": 1e-2}


def optimizer_config(name: str, clip: float) -> OptimizerConfig:
    return OptimizerConfig(name=name, lr=LR[name], weight_decay=0.1, grad_clip=clip)


def clip_for(name: str) -> float:
    """SGD runs unclipped (exact comparison); AdamW clips, exercising the global norm."""
    return 0.0 if name == "sgd" else 1.0


def train_config(world: int, opt_name: str) -> TrainConfig:
    return TrainConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH // world // MICRO, seq_len=SEQ,
                       optimizer=optimizer_config(opt_name, clip_for(opt_name)))


def batches(seed: int = 0) -> np.ndarray:
    """(steps, global batch, seq + 1) tokens; rank r trains on rows r*B/N .. (r+1)*B/N."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, MODEL.vocab_size, size=(STEPS, GLOBAL_BATCH, SEQ + 1))


def strategy_for(dp: int, stage: int, shard: int = -1, dtype: str = "float32", offload: bool = False,
                 bucket_mb: float = 0.02) -> ParallelStrategy:
    return ParallelStrategy(dp=dp, zero=ZeroSpec(stage=stage, shard_size=shard, bucket_mb=bucket_mb),
                            precision=PrecisionSpec(param_dtype=dtype, compute_dtype=dtype),
                            offload=OffloadSpec(optimizer=offload))


def model_for(case: str) -> ModelConfig:
    return MOE_MODEL if case.endswith(":moe") else MODEL


def case_name(case: str) -> str:
    """'stage:optimizer:shard_size:param_dtype:offload[:moe]' -> a file stem."""
    stage, opt, shard, dtype, offload = case.split(":")[:5]
    return f"s{stage}_{opt}_sh{shard}_{dtype}{'_off' if offload == '1' else ''}{'_moe' if case.endswith(':moe') else ''}"
