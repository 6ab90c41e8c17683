"""Training throughput of the MindSpore backend vs the torch backend, measured side by side.

Same model (configs/train/tiny_ms_dp2.yaml), same batch, same AdamW + clipping, fp32, one
process each on this machine's CPU. Prints per-step times, tokens/s and the ratio, plus a
forward-only row and MindSpore's graph compile time to show what dominates.

    .venv/bin/python bench/backends.py [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def interleaved(fns: dict, steps: int, warmup: int) -> tuple[dict, dict]:
    """Call each function once (first-call seconds: MindSpore compiles there), `warmup` more
    times, then `steps` rounds alternating between them so both see the same machine load.
    Returns (first-call seconds, median seconds) per name."""
    first = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return first, {name: statistics.median(t) for name, t in times.items()}


def torch_fns(job, batch: np.ndarray) -> dict:
    import torch
    import torch.nn.functional as F
    from torch_backend.model import Transformer

    opt = job.train.optimizer
    model = Transformer(job.model)
    model.init_weights(job.train.seed)
    optim = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                              weight_decay=opt.weight_decay)
    x = torch.from_numpy(batch)

    def step():
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optim.step()
        return loss.item()

    def forward():
        with torch.no_grad():
            return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).item()

    return {"torch step": step, "torch forward": forward}


def mindspore_fns(job, batch: np.ndarray) -> dict:
    import mindspore as ms
    from ms_llm.mindspore.model import LossCell, Transformer
    from ms_llm.mindspore.optim import AdamW
    from ms_llm.mindspore.step import TrainCell

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = Transformer(job.model)
    net.init_weights(job.train.seed)
    loss_cell = LossCell(net)
    optimizer = AdamW(loss_cell.trainable_params(), job.train.optimizer)
    step_cell = TrainCell(loss_cell, optimizer, 1, job.train.optimizer.grad_clip)
    inputs, labels = ms.Tensor(batch[None, :, :-1], ms.int32), ms.Tensor(batch[None, :, 1:], ms.int32)
    scale, lr = ms.Tensor(1.0, ms.float32), ms.Tensor(job.train.optimizer.lr, ms.float32)
    x, y = inputs[0], labels[0]
    return {"ms step": lambda: float(step_cell(inputs, labels, scale, lr)[0].asnumpy()),
            "ms forward": lambda: float(loss_cell(x, y).asnumpy())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/train/tiny_ms_dp2.yaml"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for each framework (1 keeps the comparison fair on a shared machine)")
    args = ap.parse_args()

    from ms_llm.job import load_job
    from ms_llm.data import GlobalBatchSampler, build_stdlib_corpus, load_tokens

    job = load_job(args.config)
    t = job.train
    tokens = load_tokens(build_stdlib_corpus(ROOT / ".tmp" / "bench_data"))
    batch = GlobalBatchSampler(tokens, t.seq_len, t.global_batch_size, t.seed).local_batch(0)
    tok = t.global_batch_size * t.seq_len
    import mindspore as ms
    import torch

    torch.set_num_threads(args.threads)
    ms.set_context(runtime_num_threads=args.threads)
    first, med = interleaved(torch_fns(job, batch) | mindspore_fns(job, batch), args.steps, args.warmup)
    th = {"step": med["torch step"], "forward": med["torch forward"]}
    msd = {"step": med["ms step"], "forward": med["ms forward"], "first": first["ms step"]}

    m = job.model
    print(f"model {m.name}: hidden {m.hidden_size}, {m.num_layers} layers, {m.num_heads} heads "
          f"({m.num_kv_heads} kv), vocab {m.vocab_size}; batch {t.global_batch_size} x {t.seq_len} tokens; "
          f"fp32, 1 process each, {args.threads} CPU thread(s) each, median of {args.steps} alternating steps")
    print(f"{'':28}{'torch':>12}{'mindspore':>12}{'ms / torch':>12}")
    print(f"{'fwd+bwd+AdamW step (ms)':28}{1e3 * th['step']:12.1f}{1e3 * msd['step']:12.1f}"
          f"{msd['step'] / th['step']:12.2f}")
    print(f"{'forward only (ms)':28}{1e3 * th['forward']:12.1f}{1e3 * msd['forward']:12.1f}"
          f"{msd['forward'] / th['forward']:12.2f}")
    print(f"{'backward+optimizer (ms)':28}{1e3 * (th['step'] - th['forward']):12.1f}"
          f"{1e3 * (msd['step'] - msd['forward']):12.1f}"
          f"{(msd['step'] - msd['forward']) / max(1e-9, th['step'] - th['forward']):12.2f}")
    print(f"{'tokens/s':28}{tok / th['step']:12,.0f}{tok / msd['step']:12,.0f}{th['step'] / msd['step']:12.2f}")
    print(f"{'first step incl. compile (s)':28}{'-':>12}{msd['first']:12.1f}")
    print(f"MindSpore / torch tokens/s ratio: {th['step'] / msd['step']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
