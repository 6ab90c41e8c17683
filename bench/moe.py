"""MoE on CPU, in one run: the expert compute of a 64-expert top-4 MoE layer against a dense layer
of the same active width, and expert parallelism on gloo (tokens/s of tiny_moe at ep1, ep2, ep4).

Expert compute: forward + backward (input and parameter gradients, a fixed upstream gradient) of
one torch_backend.moe.MoE layer (router, dispatch, grouped experts, combine) against a dense SwiGLU
MLP of width top_k x expert width (the same matmul FLOPs per token), on the same tokens, median of
`--repeats` alternating rounds after a warm-up, `--threads` CPU threads; wall time, and the
process's CPU time beside it (steadier where other work shares the cores). Goal: MoE / dense at most
1.5 (an MoE computing every expert over every token costs E / top_k = 16x). Beside them: the same
layer with the padded batched matmul (the path for torch builds without torch._grouped_mm), with
its experts run one by one in a Python loop (how they ran before grouped compute), and
ms_llm.mindspore.moe.MoE (a jitted forward + backward, graph mode) at the same shapes: with capacity
factor 1.25 (its static-shape token dispatch) and dropless, whose worst-case capacity gives every
expert a slot for every token, the work the MindSpore layer did before it dispatched tokens.

Activation memory, in the same run on the same tokens: the bytes one layer's forward keeps for backward
(every tensor its autograd graph saves, counted by torch.autograd.graph.saved_tensors_hooks, each
storage once, the weights left out): the dispatch's (E, C, H) buffers (the padded batched matmul, C
the largest count; with capacity factor 1.25, C at most 1.25 x tokens x top_k / E, the MindSpore
layer's static capacity) against the layer before token dispatch, every expert over every token
(E, tokens, H, the MindSpore layer's dropless worst case), and the grouped and dense layers beside.

Expert parallelism: one torchrun launch runs ep1, ep2, ep4 and ep2 x etp2 in turn on the same batches
(4 ranks, dp 4, shared ZeRO-0); each times `--steps` training steps after 2 warm-up steps, and where an
MoE layer's time goes: the all-to-all dispatch and combine (forward and backward) and, under etp, the
gather of the dispatched rows over the etp ranks and the reduce-scatter of their partial outputs, against
the experts' matmuls (forward and backward). At ep1 every rank holds all 8 experts and sends nothing; at
ep4 each holds 2 and exchanges 3/4 of its routed token copies; ep2 x etp2 (etp carved out of dp: Megatron's
MoE parallel folding) holds half the width of 4 experts. Beside the times, the memory per rank of the
routed experts' weights, gradients and AdamW states: the cost model's (ms_llm.strategy.cost, MemoryBreakdown
.experts) and the experts' buckets of rank 0's shared ZeRO engine (weights, gradients, states).

    python bench/moe.py [--tokens 4096] [--repeats 5] [--threads 1] [--steps 8] [--seq 64]
    python bench/moe.py --quick      # tiny shapes, one round: checks the bench runs, in seconds
    python bench/moe.py --table parallel --settings ep2_etp2     # some rows of one table
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402

import torch_backend.moe as moe  # noqa: E402
import torch_backend.moe_dispatch as moe_dispatch  # noqa: E402
from ms_llm.config.model import ModelConfig, MoEConfig  # noqa: E402
from ms_llm.data import GlobalBatchSampler, build_stdlib_corpus, load_tokens  # noqa: E402
from ms_llm.init import init_param  # noqa: E402
from ms_llm.job import job_from_dict  # noqa: E402
from ms_llm.machine import Machine  # noqa: E402
from ms_llm.strategy.cost import memory  # noqa: E402
from ms_llm.strategy.plan import plan as make_plan  # noqa: E402
from ms_llm.strategy.shape import cost_shape  # noqa: E402
from torch_backend.apply import apply  # noqa: E402
from torch_backend.dist import init_distributed, shutdown  # noqa: E402
from torch_backend.launch import torchrun  # noqa: E402
from torch_backend.layers import MLP  # noqa: E402
from torch_backend.lower import lower  # noqa: E402
from torch_backend.mesh import build_meshes  # noqa: E402
from torch_backend.step import TrainStep  # noqa: E402

WORLD, GLOBAL_BATCH = 4, 16
# setting -> the expert degrees over dp 4 (etp carved out of dp: the experts fold as edp x ep x etp)
SETTINGS = {"ep1": {"ep": 1}, "ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep2_etp2": {"ep": 2, "etp": 2}}
TIMES = {"all_to_all": 0.0, "etp": 0.0, "experts": 0.0}
SEED = 7


class LoopExperts(moe.Experts):
    """The experts as they ran before grouped compute: one at a time, in a Python loop, the
    outputs times their routing weights after."""

    def forward(self, rows: torch.Tensor, counts: list[int], scale: torch.Tensor) -> torch.Tensor:
        out = []
        for e, chunk in enumerate(rows.split(counts)):
            h = F.silu(chunk @ self.gate_proj.weight[e].t()) * (chunk @ self.up_proj.weight[e].t())
            out.append(h @ self.down_proj.weight[e].t())
        return (torch.cat(out) if out else rows[:0]) * scale[:, None]


class EveryExpert(torch.nn.Module):
    """The MoE layer before token dispatch: `layer`'s router and experts, every expert over every
    token ((E, tokens, H)), each output weighted by its routing weight (0 where not chosen)."""

    def __init__(self, layer: moe.MoE):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])                                            # (N, H)
        _, _, weights, top = self.layer.route(tokens)
        routed = tokens.new_zeros(tokens.shape[0], self.layer.num_experts).scatter(1, top, weights)   # (N, E)
        w1, w3, w2 = (w.weight.transpose(1, 2) for w in
                      (self.layer.experts.gate_proj, self.layer.experts.up_proj, self.layer.experts.down_proj))
        every = tokens.expand(self.layer.num_experts, *tokens.shape)                   # (E, N, H)
        out = torch.bmm(F.silu(torch.bmm(every, w1)) * torch.bmm(every, w3), w2)       # (E, N, H)
        return torch.einsum("ne,enh->nh", routed, out).view_as(x)


def layer_config(a, capacity_factor: float = -1.0) -> ModelConfig:
    return ModelConfig(name="bench_moe_layer", vocab_size=64, hidden_size=a.hidden, num_layers=1, num_heads=1,
                       ffn_hidden_size=a.top_k * a.width, dtype="float32",
                       moe=MoEConfig(num_experts=a.experts, top_k=a.top_k, expert_ffn_hidden_size=a.width,
                                     capacity_factor=capacity_factor))


def initialized(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.from_numpy(init_param(name, tuple(p.shape), SEED)))
    return module


def torch_layers(a) -> dict[str, torch.nn.Module]:
    """name -> the torch layers of the expert-compute table, initialized alike."""
    cfg = layer_config(a)
    grouped, padded, loop = moe.MoE(cfg), moe.MoE(cfg), moe.MoE(cfg)
    padded.experts.grouped = False
    loop.experts = LoopExperts(a.experts, a.hidden, a.width)
    dense = MLP(cfg, width=a.top_k * a.width)
    sides = {"torch MoE, grouped": grouped, "dense SwiGLU": dense, "torch MoE, padded bmm": padded,
             "torch MoE, loop (old)": loop}
    return {name: initialized(module) for name, module in sides.items()}


def torch_sides(a, x: np.ndarray, upstream: np.ndarray) -> dict:
    """name -> one forward + backward of that torch layer on the tokens x (1, N, H)."""
    tokens, grad = torch.from_numpy(x).requires_grad_(), torch.from_numpy(upstream)
    return {name: (lambda m=module: torch.autograd.grad(m(tokens), [tokens, *m.parameters()], grad))
            for name, module in torch_layers(a).items()}


def saved_bytes(module: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes `module`'s forward on `tokens` keeps for backward: the storages of the tensors its autograd
    graph saves, each once, its weights left out."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(tokens)
    return sum(held.values())


def activation_memory(a, x: np.ndarray) -> None:
    """Print what one MoE layer's forward keeps for backward: the dispatch's (E, C, H) buffers against
    every expert over every token (E, tokens, H), on the tokens of the expert-compute table."""
    layers = torch_layers(a)
    capped = initialized(moe.MoE(layer_config(a, 1.25)))
    capped.experts.grouped = False
    sides = {"torch MoE, grouped": layers["torch MoE, grouped"],
             "padded (E, C, H)": layers["torch MoE, padded bmm"], "padded, cap 1.25": capped,
             "every expert (E, N, H)": EveryExpert(layers["torch MoE, grouped"]),
             "dense SwiGLU": layers["dense SwiGLU"]}
    tokens = torch.from_numpy(x).requires_grad_()
    held = {name: saved_bytes(module, tokens) for name, module in sides.items()}
    every = held["every expert (E, N, H)"]
    capacity = math.ceil(1.25 * a.tokens * a.top_k / a.experts)
    print(f"activation memory: bytes one layer's forward keeps for backward (saved tensors, each storage once, "
          f"weights left out), {a.tokens} tokens, fp32; vs: against every expert over every token")
    print(f"{'layer':<24} {'saved MB':>9} {'vs every':>9}")
    for name, nbytes in held.items():
        print(f"{name:<24} {nbytes / 1e6:>9.3f} {nbytes / every:>9.3f}")
    print(f"dispatch (E, C, H) / every expert (E, {a.tokens}, H): {held['padded (E, C, H)'] / every:.3f} dropless, "
          f"{held['padded, cap 1.25'] / every:.3f} at capacity 1.25 (C <= {capacity})")


MS_SIDES = {"MindSpore MoE, cap 1.25": 1.25, "MindSpore MoE, dropless": -1.0}


def mindspore_side(a, x: np.ndarray, upstream: np.ndarray) -> dict:
    """ms_llm.mindspore.moe.MoE at each capacity factor of MS_SIDES: one jitted forward + backward
    (input and parameter gradients)."""
    import mindspore as ms

    from ms_llm.mindspore.moe import MoE

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(a.threads)
    tokens, grad = ms.Tensor(x), ms.Tensor(upstream)

    def side(capacity_factor: float):
        layer = MoE(layer_config(a, capacity_factor))
        for name, p in layer.parameters_and_names():
            p.set_data(ms.Tensor(init_param(name, tuple(p.shape), SEED)))

        def loss(t):
            return (layer(t) * grad).sum()

        step = ms.jit(ms.value_and_grad(loss, grad_position=0, weights=layer.trainable_params()))
        return lambda: step(tokens)[0].asnumpy()

    return {name: side(capacity_factor) for name, capacity_factor in MS_SIDES.items()}


def expert_compute(a) -> None:
    """Time every side in alternating rounds and print the table."""
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((1, a.tokens, a.hidden), dtype=np.float32)
    upstream = rng.standard_normal((1, a.tokens, a.hidden), dtype=np.float32)
    sides = torch_sides(a, x, upstream) | mindspore_side(a, x, upstream)
    first = {}
    for name, fn in sides.items():          # warm-up (MindSpore compiles here)
        t = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(a.repeats):
        for name, fn in sides.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    wall_ms = {name: 1e3 * statistics.median(t) for name, t in wall.items()}
    cpu_ms = {name: 1e3 * statistics.median(t) for name, t in cpu.items()}
    dense, dense_cpu = wall_ms["dense SwiGLU"], cpu_ms["dense SwiGLU"]
    print(f"expert compute: {a.experts} experts top-{a.top_k}, hidden {a.hidden}, expert width {a.width} "
          f"(dense width {a.top_k * a.width}), {a.tokens} tokens, fp32, forward + backward, {a.threads} CPU "
          f"thread(s), median of {a.repeats} alternating rounds after a warm-up; CPU: the process's CPU time")
    print(f"{'layer':<24} {'wall ms':>9} {'vs dense':>9} {'CPU ms':>9} {'vs dense':>9} {'first call s':>13}")
    for name in sides:
        print(f"{name:<24} {wall_ms[name]:>9.1f} {wall_ms[name] / dense:>9.2f} {cpu_ms[name]:>9.1f} "
              f"{cpu_ms[name] / dense_cpu:>9.2f} {first[name]:>13.2f}")
    ratio = wall_ms["torch MoE, grouped"] / dense
    print(f"MoE / dense: {ratio:.2f} wall, {cpu_ms['torch MoE, grouped'] / dense_cpu:.2f} CPU "
          f"(goal <= 1.5 wall: {'met' if ratio <= 1.5 else 'missed'}); "
          f"loop (old) / grouped: {wall_ms['torch MoE, loop (old)'] / wall_ms['torch MoE, grouped']:.1f}")
    ms_ratio = wall_ms["MindSpore MoE, cap 1.25"] / dense
    print(f"MindSpore MoE (capacity 1.25) / torch dense: {ms_ratio:.2f} wall "
          f"(goal <= 1.5 wall: {'met' if ms_ratio <= 1.5 else 'missed'}); dropless / capacity 1.25: "
          f"{wall_ms['MindSpore MoE, dropless'] / wall_ms['MindSpore MoE, cap 1.25']:.1f}")
    activation_memory(a, x)


class _Mark(torch.autograd.Function):
    """Identity; in backward, adds (now - the time `start` recorded) to TIMES[key] (end mark) or
    records the time (start mark). Brackets the experts' backward between two marks."""

    @staticmethod
    def forward(ctx, x, mark, box):
        ctx.mark, ctx.box = mark, box
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.mark == "start":
            ctx.box["t"] = time.perf_counter()
        else:
            TIMES["experts"] += time.perf_counter() - ctx.box["t"]
        return grad, None, None


def instrument() -> None:
    """Time every all_to_all_single of the MoE layer, its gathers and reduce-scatters over etp, and the
    experts' forward and backward."""
    raw_all_to_all, raw_experts = dist.all_to_all_single, moe.Experts.forward
    raw_gather, raw_scatter = moe_dispatch._all_gather_rows, moe_dispatch._reduce_scatter_rows

    def timed(fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            TIMES["etp"] += time.perf_counter() - t
            return out
        return call

    def all_to_all_single(*args, **kwargs):
        t = time.perf_counter()
        out = raw_all_to_all(*args, **kwargs)
        TIMES["all_to_all"] += time.perf_counter() - t
        return out

    def experts(self, rows, counts, scale):
        box: dict = {}
        rows = _Mark.apply(rows, "end", box)
        t = time.perf_counter()
        out = raw_experts(self, rows, counts, scale)
        TIMES["experts"] += time.perf_counter() - t
        return _Mark.apply(out, "start", box)

    moe.dist.all_to_all_single = all_to_all_single
    moe.Experts.forward = experts
    moe_dispatch._all_gather_rows, moe_dispatch._reduce_scatter_rows = timed(raw_gather), timed(raw_scatter)


def expert_bytes(lowered) -> int:
    """The routed experts' weights, gradients and optimizer states this rank holds: the buckets of the
    shared engine's partition that hold them (stage 0 here, so the gradients stay allocated)."""
    return sum(lowered.dp.engine.engine.model_state_bytes(experts=True).values())


def measure(setting: str, steps: int, seq: int, tokens_path: str) -> dict:
    model = yaml.safe_load((ROOT / "configs" / "models" / "tiny_moe.yaml").read_text())
    job = job_from_dict({
        "name": f"moe_{setting}", "device": "cpu", "model": model,
        "strategy": {"dp": WORLD, **SETTINGS[setting], "zero": {"engine": "shared"},
                     "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
        "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // WORLD, "seq_len": seq,
                  "steps": steps + 2, "seed": 7, "optimizer": {"name": "adamw", "lr": 1e-3}},
    })
    plan = make_plan(job.model, job.strategy, job.train, WORLD)
    low = lower(plan, Machine("cpu"))
    lowered = apply(low, plan, build_meshes(plan.mesh, "cpu", low.expert_mesh), torch.device("cpu"), dist.get_rank())
    step = TrainStep(lowered)
    sampler = GlobalBatchSampler(load_tokens(Path(tokens_path)), seq, GLOBAL_BATCH, 7)
    rank = dist.get_rank()
    batches = [torch.from_numpy(sampler.local_batch(k, rank, WORLD)) for k in range(steps + 2)]
    for k in range(2):
        step(k, batches[k])[0].item()
    dist.barrier()
    TIMES.update(all_to_all=0.0, etp=0.0, experts=0.0)
    t = time.perf_counter()
    for k in range(2, steps + 2):
        step(k, batches[k])[0].item()
    dist.barrier()
    wall = time.perf_counter() - t
    parts = torch.tensor([TIMES["all_to_all"], TIMES["etp"], TIMES["experts"]])
    dist.all_reduce(parts)
    ms = (1e3 * parts / WORLD / steps).tolist()
    return {"setting": setting, "tokens_per_s": steps * GLOBAL_BATCH * seq / wall, "step_ms": 1e3 * wall / steps,
            "all_to_all_ms": ms[0], "etp_ms": ms[1], "experts_ms": ms[2],
            "model_mb": memory(cost_shape(plan)).experts / 1e6, "measured_mb": expert_bytes(lowered) / 1e6}


def worker(args) -> None:
    init_distributed()
    torch.set_num_threads(1)
    instrument()
    rows = [measure(setting, args.steps, args.seq, args.corpus) for setting in args.settings.split(",")]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    shutdown()


def expert_parallel(args) -> None:
    """Launch the workers of the ep settings and print their table."""
    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    corpus = str(build_stdlib_corpus(tmp / "bench-data", max_bytes=1_000_000))
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [*torchrun(WORLD), __file__, "--worker", "--corpus", corpus, "--steps", str(args.steps),
           "--seq", str(args.seq), "--settings", args.settings]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.exit(f"bench failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    rows = json.loads(lines[0][len("RESULT "):])
    base = rows[0]["tokens_per_s"]
    print(f"expert parallel: tiny_moe (8 experts, top-2, 2 MoE layers), {WORLD} gloo ranks x 1 thread, dp {WORLD}, "
          f"global batch {GLOBAL_BATCH} x seq {args.seq}, AdamW, fp32; {args.steps} timed steps per row; "
          f"per-rank ms per step; vs: tokens/s against the first row; expert MB: the routed experts' weights, "
          f"gradients and AdamW states per rank, cost model and measured on rank 0")
    print(f"{'setting':<9} {'tokens/s':>9} {'vs':>5} {'step ms':>8} {'all-to-all ms':>14} {'etp ms':>7} "
          f"{'experts ms':>11} {'comm/experts':>13} {'expert MB model':>16} {'measured':>9}")
    for r in rows:
        comm = r["all_to_all_ms"] + r["etp_ms"]
        ratio = comm / r["experts_ms"] if r["experts_ms"] else float("nan")
        print(f"{r['setting']:<9} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base:>5.2f} {r['step_ms']:>8.1f} "
              f"{r['all_to_all_ms']:>14.2f} {r['etp_ms']:>7.2f} {r['experts_ms']:>11.2f} {ratio:>13.2f} "
              f"{r['model_mb']:>16.3f} {r['measured_mb']:>9.3f}")


QUICK = {"experts": 8, "top_k": 2, "hidden": 32, "width": 16, "tokens": 64, "repeats": 1, "steps": 1, "seq": 16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--width", type=int, default=256, help="one expert's SwiGLU width")
    p.add_argument("--tokens", type=int, default=4096, help="tokens through the MoE and dense layers")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of the expert-compute table")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the expert-compute table, both backends")
    p.add_argument("--steps", type=int, default=8, help="timed training steps per ep setting")
    p.add_argument("--seq", type=int, default=64, help="sequence length of the ep settings")
    p.add_argument("--quick", action="store_true", help="tiny shapes, one round, one step: seconds")
    p.add_argument("--table", choices=("all", "compute", "parallel"), default="all",
                   help="the expert-compute table (with activation memory), the expert-parallel one, or both (default)")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated rows of the expert-parallel table, of {', '.join(SETTINGS)} (default all)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--corpus", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        vars(args).update(QUICK)
    unknown = set(args.settings.split(",")) - set(SETTINGS)
    if unknown:
        p.error(f"--settings: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SETTINGS)}")
    if args.table in ("all", "compute"):
        expert_compute(args)
    if args.table == "all":
        print()
    if args.table in ("all", "parallel"):
        expert_parallel(args)


if __name__ == "__main__":
    main()
