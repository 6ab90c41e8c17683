"""What each backend can run, asked before any process starts.

The CLI layer (this module, ms_llm.cli, ms_llm.launch) dispatches to each backend's
framework-free support.py; the core below it (strategy, zero, checkpoint, run) imports no
backend. A backend's support module answers `refusals(plan, machine)`, `check(plan,
machine)` and `zero_engine(plan, machine)`; `machine` defaults to this one.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Optional

from ms_llm.errors import StrategyError
from ms_llm.machine import Machine
from ms_llm.mindspore import support as mindspore_support
from ms_llm.strategy.plan import ModelPlan
from torch_backend import support as torch_support

SUPPORT: dict[str, ModuleType] = {"torch": torch_support, "mindspore": mindspore_support}
BACKENDS = tuple(SUPPORT)


def support(backend: str) -> ModuleType:
    """The backend's support module (torch_backend.support, ms_llm.mindspore.support)."""
    if backend not in SUPPORT:
        raise StrategyError(f"--backend: {backend!r} is not a backend; use one of {', '.join(BACKENDS)}")
    return SUPPORT[backend]


def refusals(backend: str, plan: ModelPlan, machine: Optional[Machine] = None) -> list[str]:
    """Every reason `backend` cannot run `plan` on `machine` (default: this one); empty: it can."""
    return support(backend).refusals(plan, machine or Machine.detect())


def check(backend: str, plan: ModelPlan, machine: Optional[Machine] = None) -> None:
    """Raise one StrategyError listing every refusal of `backend` for `plan`."""
    support(backend).check(plan, machine or Machine.detect())


def zero_engine(backend: str, plan: ModelPlan, machine: Optional[Machine] = None) -> str:
    """The engine `backend` runs the plan's data parallelism with (StrategyError when refused)."""
    return support(backend).zero_engine(plan, machine or Machine.detect())


@dataclass(frozen=True)
class Verdict:
    """One backend's answer for one plan on one machine, as `ms-llm plan` prints it."""
    backend: str
    machine: Machine
    engine: Optional[str]          # None when the engine choice itself is refused
    refusals: tuple[str, ...]

    @property
    def runs(self) -> bool:
        return not self.refusals

    def lines(self) -> list[str]:
        head = f"backend    {self.backend} on {self.machine.accelerator}: "
        engine = f"ZeRO engine {self.engine}" if self.engine is not None else ""
        if self.runs:
            return [head + engine]
        return [head + (f"{engine}; refused:" if engine else "refused:")] + [f"  - {p}" for p in self.refusals]

    def to_json(self) -> dict:
        return {"backend": self.backend, "accelerator": self.machine.accelerator, "engine": self.engine,
                "runs": self.runs, "refusals": list(self.refusals)}


def verdict(backend: str, plan: ModelPlan, machine: Optional[Machine] = None) -> Verdict:
    machine = machine or Machine.detect()
    rules = support(backend)
    try:
        engine: Optional[str] = rules.zero_engine(plan, machine)
    except StrategyError:
        engine = None
    return Verdict(backend, machine, engine, tuple(rules.refusals(plan, machine)))
