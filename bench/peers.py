"""ms_llm's torch trainer step against torchtitan's FSDP on the same tiny LLaMA, dp2 on gloo, in one run.

    .venv/bin/python bench/peers.py [--repeats 6] [--steps 2]

Both sides: configs/models/tiny.yaml's shape, fp32, AdamW + clipping, the same global batch of 8 x 128
tokens from the same sampler, FSDP over 2 ranks (gloo, one thread each). ms_llm runs its own step
(torch_backend TrainStep) twice: strategy zero stage 3 on torch's FSDP2 (engine native) and on
ms_llm's shared ZeRO-3 engine. torchtitan (0.3.0, from .oracles) runs its own Llama3Model built
like its flavors, its parallelize_llama (FSDP2 per block, then the root) and its clip_grad_norm_.
The three take turns a few steps at a time (order rotating) so machine noise hits all alike; the
median of the per-turn time ratios torchtitan / ms_llm is the tokens/s ratio (>1: ms_llm faster).

Why not torchtitan's own trainer (torchtitan.train): on a CPU-only machine it cannot start.
torchtitan.tools.utils.get_device_info() falls back to "cuda" when torch sees no accelerator, and
Trainer.__init__ calls torch.cuda.set_device, which a CPU build of torch fails with
"AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'" (its process group would
also be nccl); here it stops even earlier, importing torchtitan.components.dataloader
("ModuleNotFoundError: No module named 'torchdata'", not a dependency we install). So the bench
applies torchtitan's parallelize function to its own model instead, and points the one module
that builds meshes (torchtitan.distributed.parallel_dims, device_type "cuda") at "cpu".
Its language-model attention is FlexAttention (0.3.0 refuses SDPA for LMs), run eagerly here:
part of any difference is that kernel, not the framework around it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORACLES = ROOT / ".oracles"
GLOBAL_BATCH, SEQ = 8, 128
SIDES = ("ms_llm fsdp2", "ms_llm zero3", "torchtitan")


def job_for(world: int, engine: str):
    from ms_llm.config.job import job_from_dict
    return job_from_dict({
        "name": "peers", "device": "cpu", "model": "tiny",
        "strategy": {"dp": world, "zero": {"stage": 3, "engine": engine},
                     "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
        "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // world, "seq_len": SEQ,
                  "steps": 1000, "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"warmup_steps": 10}},
    })


def ours(world: int, rank: int, engine: str):
    """ms_llm's own step, as its torch worker builds it."""
    import torch

    from ms_llm.machine import Machine
    from ms_llm.strategy.plan import plan as make_plan
    from torch_backend.apply import apply
    from torch_backend.lower import lower
    from torch_backend.mesh import build_meshes
    from torch_backend.step import TrainStep

    job = job_for(world, engine)
    plan = make_plan(job.model, job.strategy, job.train, world)
    step = TrainStep(apply(lower(plan, Machine("cpu")), plan, build_meshes(plan.mesh, "cpu"), torch.device("cpu"), rank))
    return lambda k, batch: step(k, batch)[0]


def titan_model_config(m):
    """torchtitan's Llama3Model.Config for ms_llm's model shape, built the way its flavors are
    (torchtitan/models/llama3/__init__.py, _debugmodel)."""
    import torchtitan.models.llama3 as titan
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model
    return Llama3Model.Config(
        dim=m.hidden_size, vocab_size=m.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=m.hidden_size,
                                        param_init=titan._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=m.hidden_size, param_init=titan._NORM_INIT),
        lm_head=Linear.Config(in_features=m.hidden_size, out_features=m.vocab_size,
                              param_init=titan._output_linear_init(m.hidden_size)),
        layers=titan._build_llama3_layers(
            n_layers=m.num_layers, dim=m.hidden_size, n_heads=m.num_heads, n_kv_heads=m.num_kv_heads,
            hidden_dim=m.ffn_hidden_size, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=m.hidden_size // m.num_heads, max_seq_len=SEQ, theta=m.rope_theta)))


def torchtitan(world: int, tc, m):
    """torchtitan's model on the meta device, its parallelize_llama (FSDP over dp_shard), then
    materialised and initialised as its Trainer does; its clip_grad_norm_; the same AdamW."""
    import torch
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import parallelize_llama

    from ms_llm.run import lr_at
    from torch_backend.apply import cross_entropy
    from torch_backend.step import optimizer_args

    titan_dims.device_type = "cpu"                 # its accelerator probe says "cuda" on a CPU machine
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend="partial_dtensor")
    dims = titan_dims.ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = titan_model_config(m).build()
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32", seq_len=SEQ)
    parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                      compile_config=CompileConfig(enable=False), ac_config=None, dump_folder=str(ROOT / ".tmp"))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states()
    cls, params, kwargs = optimizer_args(tc.optimizer, list(model.parameters()))
    opt = cls(params, **kwargs)
    positions = torch.arange(SEQ).expand(GLOBAL_BATCH // world, SEQ)     # one document per row
    masks = model.get_attention_masks(positions=positions)

    def step(k: int, batch):
        for g in opt.param_groups:
            g["lr"] = lr_at(k, tc)
        loss = cross_entropy(model(batch[:, :-1], positions=positions, attention_masks=masks), batch[:, 1:])
        loss.backward()
        clip_grad_norm_(model.parameters(), tc.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from ms_llm.data import GlobalBatchSampler, load_tokens
    from torch_backend.dist import init_distributed, shutdown

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    job = job_for(world, "native")
    runners = {"ms_llm fsdp2": ours(world, rank, "native"), "ms_llm zero3": ours(world, rank, "shared"),
               "torchtitan": torchtitan(world, job.train, job.model)}
    sampler = GlobalBatchSampler(load_tokens(Path(args.tokens)), SEQ, GLOBAL_BATCH, job.train.seed)
    batches = [torch.from_numpy(sampler.local_batch(k, rank, world)).long() for k in range(args.steps)]
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    losses: dict[str, float] = {}
    for r in range(args.repeats + 1):                 # repeat 0 warms every side up and is dropped
        for name in SIDES[r % 3:] + SIDES[:r % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            for k, batch in enumerate(batches):
                losses[name] = float(runners[name](k, batch))
            if r:
                times[name].append((time.perf_counter() - t0) / args.steps)
    if rank == 0:
        tokens = GLOBAL_BATCH * SEQ
        result = {name: {"tokens_per_s": tokens / statistics.median(times[name]), "last_loss": losses[name],
                         "ratio": statistics.median(t / o for t, o in zip(times["torchtitan"], times[name]))}
                  for name in SIDES}
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Needs torchtitan in .oracles (make oracles).")
    p.add_argument("--repeats", type=int, default=6, help="timed turns of each side (default 6)")
    p.add_argument("--steps", type=int, default=2, help="steps per turn (default 2)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokens", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        return worker(args)
    if not (ORACLES / "torchtitan").is_dir():
        sys.exit("peers: .oracles/ has no torchtitan; run `make oracles`")

    from ms_llm.data import build_stdlib_corpus
    from torch_backend.launch import torchrun

    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    tokens = str(build_stdlib_corpus(tmp / "bench-data", max_bytes=1_000_000))
    # .oracles last: torchtitan and its pure-Python dependencies, never in front of .venv's torch.
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(ROOT), str(ORACLES)]),
               OMP_NUM_THREADS="1")
    cmd = [*torchrun(2), __file__, "--worker", "--tokens", tokens, "--repeats", str(args.repeats),
           "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.exit(f"peers: bench failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    res = json.loads(lines[0][len("RESULT "):])
    print(f"peers: model tiny, fp32, AdamW + clip, global batch {GLOBAL_BATCH} x {SEQ} tokens, FSDP dp2 on gloo "
          f"(1 thread per rank); {args.repeats} rotating turns of {args.steps} steps; median step times")
    print(f"{'side':<14} {'tokens/s':>10} {'vs torchtitan':>14} {'last loss':>10}")
    for name in SIDES:
        r = res[name]
        print(f"{name:<14} {r['tokens_per_s']:>10,.0f} {r['ratio']:>14.3f} {r['last_loss']:>10.4f}")
    print("torchtitan: its parallelize_llama on its own Llama3Model (its trainer cannot start on a CPU-only "
          "machine: see bench/peers.py --help)")


if __name__ == "__main__":
    main()
