"""DeepSpeed's own engine on CPU trains, saves, resumes and converts the checkpoints that
tests/checkpoint/test_import_deepspeed.py imports and exports. Run with PYTHONPATH=.oracles:<checkout>.

argv[1]: a JSON spec, argv[2]: JSON out. This process starts `world` ranks of itself (gloo,
DS_ACCELERATOR=cpu); they share every engine in turn:
  {"world": 2, "model": {LlamaConfig keywords}, "seed": 0, "then": path,
   "data": {"tokens": uint16 token file, "seq_len": 16, "global_batch": 4, "seed": 7},
   "train": [{"name", "config": ds_config, "save": dir, "steps": N, "more": M}],
        a fresh transformers LlamaForCausalLM (torch.manual_seed(seed)) under deepspeed.initialize trains
        N steps, save_checkpoint(dir, tag=global_stepN) (and the model's config.json), then M steps
        more: its own continuation
   "resume": [{"name", "folder": dir, "steps": K}],
        a fresh engine with dir/ds_config.json loads dir (load_checkpoint, optimizer and scheduler
        states too) and trains K steps from its global_steps
   "universal": [dir], "fp32": [dir]}
        rank 0 then runs ds_to_universal on the save `latest` names (into <tag>_universal) and
        zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint (into dir/zero_to_fp32.safetensors)
out: {"losses": {name: {step: loss}}, "lr": {name: {step: lr}}}
With "then", the ranks wait (at most peer_probe.WAIT_S) for that file to appear: a spec of more work of the
same kinds with its own "out" path (and "then"), or {} to stop. So a test module pays for one
start of DeepSpeed (most of its cost: the imports) while ms_llm's runs make what it resumes from.
Step k trains on ms_llm's global batch k (GlobalBatchSampler over the same token file, dp rank r
taking its rows), with ms_llm's loss: the mean token cross-entropy of the global batch, so the
losses compare with `ms-llm train`'s metrics (its step k + 1).

DeepSpeed's AdamW runs as torch.optim.AdamW ("torch_adam": true), not its FusedAdam C++ op, and
its shared-memory all-reduce (used only by inference_all_reduce) is not built: both are JIT
compiles of minutes on a fresh machine, and neither is what the checkpoint format depends on.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from peer_probe import next_spec

TIMEOUT_S = 1800        # the whole probe, waits included


def batch(data: dict, step: int, rank: int, world: int):
    import torch
    from ms_llm.data.corpus import load_tokens
    from ms_llm.data.sampler import GlobalBatchSampler
    sampler = GlobalBatchSampler(load_tokens(Path(data["tokens"])), data["seq_len"], data["global_batch"], data["seed"])
    rows = torch.from_numpy(sampler.local_batch(step, rank, world))
    return rows[:, :-1], rows[:, 1:]


def train_steps(engine, data: dict, first: int, count: int, rank: int, world: int) -> tuple[dict, dict]:
    """`count` steps from global batch `first`: {step: global mean loss}, {step: lr used}."""
    import torch
    import torch.nn.functional as F
    import deepspeed.comm as dist
    losses, lrs = {}, {}
    for step in range(first, first + count):
        inputs, targets = batch(data, step, rank, world)
        lrs[step] = engine.get_lr()[0]
        logits = engine(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / world
    return losses, lrs


def engine_for(spec: dict, config: dict):
    import deepspeed
    import torch
    import transformers
    torch.manual_seed(spec.get("seed", 0))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec["model"]))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def with_torch_adam(config: dict) -> dict:
    optimizer = dict(config.get("optimizer") or {"type": "AdamW"})
    optimizer["params"] = {**optimizer.get("params", {}), "torch_adam": True}
    return {**config, "optimizer": optimizer}


def worker(spec: dict, out_path: str) -> None:
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    while spec:
        work(spec, out_path)
        if not spec.get("then"):
            break
        out_path, spec = wait_for(Path(spec["then"]), spec)


def wait_for(path: Path, spec: dict) -> tuple[str, dict]:
    """The next spec (its out path and its work, with this run's model and data), once it appears."""
    nxt = next_spec(path)
    if not nxt:
        return "", {}
    return nxt["out"], {**{k: spec[k] for k in ("world", "model", "seed", "data") if k in spec}, **nxt}


def work(spec: dict, out_path: str) -> None:
    rank, world = int(os.environ["RANK"]), spec["world"]
    data = spec["data"]
    out = {"losses": {}, "lr": {}}
    for run in spec.get("train", []):
        engine = engine_for(spec, with_torch_adam(run["config"]))
        losses, lrs = train_steps(engine, data, 0, run["steps"], rank, world)
        engine.save_checkpoint(run["save"], tag=f"global_step{run['steps']}")
        if rank == 0:                   # the model's config beside the save, as transformers' Trainer keeps it
            engine.module.config.save_pretrained(run["save"])
        more, more_lrs = train_steps(engine, data, run["steps"], run["more"], rank, world)
        out["losses"][run["name"]], out["lr"][run["name"]] = {**losses, **more}, {**lrs, **more_lrs}
        del engine
    for run in spec.get("resume", []):
        config = json.loads((Path(run["folder"]) / "ds_config.json").read_text())
        engine = engine_for(spec, with_torch_adam(config))
        path, _ = engine.load_checkpoint(run["folder"])
        if path is None:
            raise SystemExit(f"DeepSpeed found no checkpoint in {run['folder']}")
        out["losses"][run["name"]], out["lr"][run["name"]] = train_steps(
            engine, data, engine.global_steps, run["steps"], rank, world)
        del engine
    if rank == 0:
        convert(spec)
        Path(out_path + ".tmp").write_text(json.dumps(out))
        os.replace(out_path + ".tmp", out_path)


def convert(spec: dict) -> None:
    """DeepSpeed's own converters on the saves (one process: ds_to_universal works serially)."""
    from types import SimpleNamespace
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file
    for folder in spec.get("universal", []):      # inject_missing_state: a plain engine's save lacks the
        tag = (Path(folder) / "latest").read_text().strip()     # universal_checkpoint_info Megatron-DeepSpeed adds
        ds_to_universal(SimpleNamespace(input_folder=str(Path(folder) / tag),
                                        output_folder=str(Path(folder) / f"{tag}_universal"),
                                        num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                        inject_missing_state=True))
    for folder in spec.get("fp32", []):
        state = get_fp32_state_dict_from_zero_checkpoint(folder)
        save_file({k: v.detach().contiguous() for k, v in state.items()},
                  str(Path(folder) / "zero_to_fp32.safetensors"))


def launch(spec: dict, out_path: str) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(spec["world"]):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec["world"]),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", sys.argv[1], out_path], env=env))
    deadline = time.monotonic() + TIMEOUT_S
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            codes.append(124)
    return max(codes, key=abs)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(json.loads(Path(sys.argv[2]).read_text()), sys.argv[3])
    else:
        sys.exit(launch(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]))
