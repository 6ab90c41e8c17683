"""torchtitan 0.3's ConfigManager reads the jobs ms_llm writes: run with PYTHONPATH=.oracles.

argv[1]: a JSON file {name: [argument, ...]} (--module, --config and the overrides, as torchrun
passes them to torchtitan.train). Each list goes through ConfigManager.parse_args, which loads the
registered config and applies the overrides with tyro (an unknown flag or a bad value exits).
argv[2]: JSON out, {name: {"ok": values read back} or {"error": message}}.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys

from torchtitan.config.manager import ConfigManager


def read(args: list[str]) -> dict:
    cfg = ConfigManager().parse_args(args)
    p, t, o = cfg.parallelism, cfg.training, cfg.optimizer.param_groups[0].optimizer_kwargs
    return {"dp_replicate": p.data_parallel_replicate_degree, "dp_shard": p.data_parallel_shard_degree,
            "tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree, "cp": p.context_parallel_degree,
            "pp_schedule": p.pipeline_parallel_schedule, "layers_per_stage": p.pipeline_parallel_layers_per_stage,
            "local_batch_size": t.local_batch_size, "global_batch_size": t.global_batch_size,
            "seq_len": t.seq_len, "steps": t.steps, "lr": o["lr"], "betas": list(o["betas"]),
            "activation_checkpoint": type(cfg.activation_checkpoint).__qualname__.split(".")[0],
            "checkpoint": [cfg.checkpoint.enable, cfg.checkpoint.interval], "seed": cfg.debug.seed}


def main(cases: dict) -> dict:
    out = {}
    for name, args in cases.items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                out[name] = {"ok": read(args)}
        except SystemExit:                      # tyro's verdict on a bad argument, printed to stderr
            out[name] = {"error": err.getvalue()[-2000:]}
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(main(cases), f)
