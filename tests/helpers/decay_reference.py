"""The reference for train.optimizer.weight_decay_1d false: torch.optim.AdamW with Megatron-LM's
default param groups (no weight decay on biases and 1-D parameters), the whole global batch in
one process. Every optimizer path of both backends must equal it; the same loop with one group
(decay on everything) is the control that shows a test can tell the two apart.

Shared by tests/torch/test_torch_weight_decay.py (and its torchrun worker) and
tests/mindspore/test_ms_weight_decay.py."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ms_llm.config.train import OptimizerConfig
from ms_llm.job import JobConfig, job_from_dict

# Qwen's extra parameters give the model biases (q/k/v) and per-head norms beside the RMSNorm weights.
MODEL = dict(name="decay", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=16, qkv_bias=True, qk_norm=True, dtype="float32")
# Routed experts (3-D, decayed) beside dense 1-D parameters; router losses and the expert bias off,
# so the plain model's cross entropy is the loss the trainer optimizes.
MOE = dict(MODEL, name="decay_moe", moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_size=16, aux_loss_coeff=0.0,
                                             z_loss_coeff=0.0, expert_bias=False))
# eps 1e-5: Adam's m / (sqrt(v) + eps) turns the float noise of near-zero gradients (another reduction
# order, another framework's kernels) into 1e-5-sized parameter differences at eps 1e-8 / 1e-6.
OPT = dict(name="adamw", lr=1e-2, weight_decay=0.1, eps=1e-5, grad_clip=1.0, weight_decay_1d=False)
STEPS, GLOBAL, MICRO, SEQ = 3, 8, 4, 16       # MICRO micro-batches of the global batch in one process


def job(strategy: dict, model: dict = MODEL) -> JobConfig:
    """`strategy` with micro-batches of GLOBAL / MICRO rows and a constant learning rate."""
    return job_from_dict({
        "name": model["name"], "device": "cpu", "model": model,
        "strategy": {**strategy, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
        "train": {"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL // MICRO,
                  "seq_len": SEQ, "steps": STEPS, "seed": 7, "optimizer": OPT,
                  "schedule": {"warmup_steps": 0, "decay": "constant"}},
    })


def batches(vocab: int = 64) -> np.ndarray:
    """(steps, global batch, seq + 1) token ids."""
    return np.random.default_rng(3).integers(0, vocab, (STEPS, GLOBAL, SEQ + 1))


def param_groups(model: torch.nn.Module, exempt: bool) -> list[dict]:
    """Megatron-LM's default no_weight_decay_cond (biases and 1-D parameters), or one group."""
    named = list(model.named_parameters())
    if not exempt:
        return [{"params": [p for _, p in named]}]
    free = [n.endswith(".bias") or p.ndim == 1 for n, p in named]
    assert any(free) and not all(free)
    return [{"params": [p for (_, p), f in zip(named, free) if not f]},
            {"params": [p for (_, p), f in zip(named, free) if f], "weight_decay": 0.0}]


def train(model: torch.nn.Module, steps: np.ndarray, micro_batches: int, opt: OptimizerConfig,
          exempt: bool = True) -> list[float]:
    """AdamW steps over `steps` (steps, rows, seq + 1), each split into `micro_batches`, clipped to
    opt.grad_clip; returns the losses. `model` is trained in place."""
    optim = torch.optim.AdamW(param_groups(model, exempt), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                              weight_decay=opt.weight_decay)
    losses = []
    for step in torch.from_numpy(steps):
        total = 0.0
        for mb in step.chunk(micro_batches):
            logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / micro_batches
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return losses


def worst(got: dict[str, np.ndarray], want: torch.nn.Module) -> float:
    """Largest absolute difference over every parameter of `want`."""
    return max(float(np.abs(got[n] - p.detach().numpy()).max()) for n, p in want.named_parameters())
