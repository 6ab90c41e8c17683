"""What failed, and whether trying again can help.

Transient: a process died (killed, lost its machine), a rank hung (stopped, a blocked
collective), a launch that failed without saying why. Deterministic, never retried: a cause
that repeats by nature (ms_llm.run.heartbeat.DETERMINISTIC: divergence, a bad config, a full
or read-only disk), the same error on every rank, or the same error at the same step as an
earlier failure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ms_llm.run.heartbeat import DETERMINISTIC


@dataclass(frozen=True)
class Failure:
    kind: str                        # "exit" (a worker reported an error), "died", "hang", "launcher", "startup"
    ranks: tuple[int, ...]           # the ranks it names (empty: unknown)
    step: int                        # the newest step every rank had completed
    detail: str                      # one line for the log and the report
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)   # rank -> (cause, error line)

    def signature(self) -> Optional[tuple[int, str]]:
        """(step, error) when one error explains it, for 'the same error twice at the same step'."""
        texts = {e for _, e in self.errors.values()}
        return (self.step, texts.pop()) if len(texts) == 1 else None


def deterministic(failure: Failure, earlier: list[Failure], world: int) -> Optional[str]:
    """The reason not to retry, or None when a restart may succeed."""
    for rank, (cause, error) in sorted(failure.errors.items()):
        if cause in DETERMINISTIC:
            return f"{DETERMINISTIC[cause]} (rank {rank}: {error})"
    texts = {e for _, e in failure.errors.values()}
    if world > 1 and len(failure.errors) == world and len(texts) == 1:
        return f"every rank failed with the same error: {texts.pop()}"
    sig = failure.signature()
    if sig is not None and any(f.signature() == sig for f in earlier):
        return f"the same error at step {sig[0]} as before: {sig[1]}"
    return None
