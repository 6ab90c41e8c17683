"""DeepSpeed's own DeepSpeedConfig reads the JSON ms_llm writes: run with PYTHONPATH=.oracles.

DeepSpeedConfig takes the data-parallel world size from the `mpu` it is handed (Megatron's
parallel-state interface: get_data_parallel_world_size), after deepspeed.comm answers get_rank, so
one gloo process stands for a job of any size. DS_ACCELERATOR=cuda keeps DeepSpeed from compiling
its CPU shared-memory op on start (config parsing does not depend on the device).

argv[1]: a JSON file {name: {"config": ds json, "dp": data-parallel ranks}}; argv[2]: JSON out,
{name: {"ok": values DeepSpeed derived} or {"error": message}}.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta


class DataParallelGroups:
    """The one query DeepSpeedConfig makes of Megatron's parallel state."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def main(cases: dict) -> dict:
    import torch.distributed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import deepspeed.comm.comm as comm
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.runtime.config import DeepSpeedConfig
    comm.cdb = TorchBackend("gloo", timedelta(seconds=60), None)
    out = {}
    for name, case in cases.items():
        try:
            c = DeepSpeedConfig(case["config"], mpu=DataParallelGroups(case["dp"]))
        except (ValueError, AssertionError, TypeError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = {"ok": {"world_size": c.world_size, "train_batch_size": c.train_batch_size,
                            "micro_batch": c.train_micro_batch_size_per_gpu,
                            "gradient_accumulation_steps": c.gradient_accumulation_steps,
                            "zero_stage": c.zero_optimization_stage, "bf16": c.bfloat16_config.enabled,
                            "fp16": c.float16_config.enabled, "gradient_clipping": c.gradient_clipping,
                            "offload_optimizer": c.zero_config.offload_optimizer is not None and
                            str(c.zero_config.offload_optimizer.device) not in ("none", "OffloadDeviceEnum.none")}}
    torch.distributed.destroy_process_group()
    return out


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(main(cases), f)
