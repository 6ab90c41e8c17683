"""Activation memory per rank under context parallel, measured, beside the cost model's figure.
Run under torchrun (2 ranks) by tests/torch/test_torch_cp_memory.py:

    torchrun --nproc-per-node 2 tests/helpers/torch_cp_memory_worker.py OUT

For each strategy, one micro-batch's forward on the lowered model, with autograd's
saved-tensor hooks counting the bytes kept for backward (each storage once): what the cost
model's activation and logits terms stand for. Rank 0 writes {case: [measured, modelled]}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy.cost import memory
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.apply import apply, cross_entropy
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.step import TrainStep

MODEL = dict(name="cp-memory", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=128, max_seq_len=512, dtype="float32")
CASES = {"dp2": {"dp": 2}, "cp2_ring": {"cp": 2, "context_parallel": {"algorithm": "ring"}},
         "cp2_ulysses": {"cp": 2, "context_parallel": {"algorithm": "ulysses"}},
         "cp2_allgather": {"cp": 2, "context_parallel": {"algorithm": "allgather"}}}


def saved_bytes(fn, params) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs, parameters
    (model states, not activations) left out."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(case: str) -> tuple[int, float]:
    job = job_from_dict({"name": case, "device": "cpu", "model": MODEL,
                         "strategy": {**CASES[case], "precision": {"param_dtype": "float32", "compute_dtype": "float32"},
                                      "zero": {"engine": "native"}},
                         "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 512, "steps": 1}})
    plan = make_plan(job.model, job.strategy, job.train, dist.get_world_size())
    lowered = apply(lower(plan, Machine("cpu")), plan, build_meshes(plan.mesh, "cpu"), torch.device("cpu"),
                    dist.get_rank())
    step = TrainStep(lowered)
    batch = torch.randint(0, MODEL["vocab_size"], (2, 513), generator=torch.Generator().manual_seed(0))
    tokens, targets = step.context_share(batch[:, :-1], batch[:, 1:])
    part = lowered.parts[0]
    measured = saved_bytes(lambda: cross_entropy(part(tokens), targets), part.parameters())
    mem = memory(plan)
    return measured, mem.activations + mem.logits


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    results = {case: measure(case) for case in CASES}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
