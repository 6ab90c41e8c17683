"""The machine a backend runs on, described without importing a framework.

What a backend can run depends on the accelerator (MindSpore compiles semi_auto_parallel
only on Ascend and has no bfloat16 MatMul on CPU), and the question is asked before any
worker starts, so the answer may not cost a torch or MindSpore import: the accelerator is
read off the device files its driver creates.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ms_llm.errors import ConfigError
from ms_llm.strategy.devices import DEVICES, DeviceSpec

Accelerator = Literal["cuda", "ascend", "cpu"]
ACCELERATORS: tuple[str, ...] = ("cuda", "ascend", "cpu")
# The cost model's devices (ms_llm.strategy.devices) -> the accelerator that runs them.
DEVICE_ACCELERATORS: dict[str, Accelerator] = {"h100": "cuda", "h800": "cuda", "h200": "cuda", "a100": "cuda",
                                               "910b": "ascend", "cpu": "cpu"}


@dataclass(frozen=True)
class Machine:
    accelerator: Accelerator = "cpu"

    def __post_init__(self) -> None:
        if self.accelerator not in ACCELERATORS:
            raise ConfigError(f"machine: unknown accelerator {self.accelerator!r}; use one of "
                              f"{', '.join(ACCELERATORS)}")

    @classmethod
    def detect(cls, dev: Path = Path("/dev")) -> "Machine":
        """This machine: Ascend when the NPU driver's /dev/davinci0 exists, CUDA for /dev/nvidia0."""
        if (dev / "davinci0").exists():
            return cls("ascend")
        if (dev / "nvidia0").exists():
            return cls("cuda")
        return cls("cpu")

    @classmethod
    def running(cls, device: DeviceSpec) -> "Machine":
        """The machine a plan for `device` (a cost-model device: h100, 910b, cpu, ...) runs on."""
        key = next(k for k, spec in DEVICES.items() if spec == device)
        return cls(DEVICE_ACCELERATORS[key])
