"""The model, batches and settings of the train.optimizer.weight_decay_1d tests, shared by both
backends (numpy only: MindSpore workers import it); the torch reference is decay_reference.py."""
from __future__ import annotations

import numpy as np

from ms_llm.job import JobConfig, job_from_dict

# Qwen's extra parameters give the model biases (q/k/v) and per-head norms beside the RMSNorm weights.
MODEL = dict(name="decay", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=16, qkv_bias=True, qk_norm=True, dtype="float32")
# Routed experts (3-D: decayed) beside dense 1-D parameters; router losses and the expert bias off,
# so the plain model's cross entropy is the loss the trainer optimizes.
MOE = dict(MODEL, name="decay_moe", moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_size=16, aux_loss_coeff=0.0,
                                             z_loss_coeff=0.0, expert_bias=False))
# eps 1e-5: Adam's m / (sqrt(v) + eps) turns the float noise of near-zero gradients (another reduction
# order, another framework's kernels) into 1e-5-sized parameter differences at eps 1e-8 / 1e-6.
OPT = dict(name="adamw", lr=1e-2, weight_decay=0.1, eps=1e-5, grad_clip=1.0, weight_decay_1d=False)
STEPS, GLOBAL, MICRO, SEQ, SEED = 3, 8, 4, 16, 7   # MICRO micro-batches of the global batch in one process


def job(strategy: dict, model: dict = MODEL) -> JobConfig:
    """`strategy` with micro-batches of GLOBAL / MICRO rows and a constant learning rate."""
    return job_from_dict({
        "name": model["name"], "device": "cpu", "model": model,
        "strategy": {**strategy, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
        "train": {"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL // MICRO,
                  "seq_len": SEQ, "steps": STEPS, "seed": SEED, "optimizer": OPT,
                  "schedule": {"warmup_steps": 0, "decay": "constant"}},
    })


def batches(vocab: int = MODEL["vocab_size"]) -> np.ndarray:
    """(steps, global batch, seq + 1) token ids."""
    return np.random.default_rng(3).integers(0, vocab, (STEPS, GLOBAL, SEQ + 1))
