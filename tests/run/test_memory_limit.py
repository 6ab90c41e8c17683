"""train.memory_limit_gb: RLIMIT_DATA really caps a worker, and running past it is one line that
names the limit and the fixes (ms_llm/run/memory.py). The long-sequence run it enables, cp4
training 4x the sequence cp1 can, is bench/context_parallel.py --long."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ms_llm.errors import OutOfMemory
from ms_llm.run.heartbeat import DETERMINISTIC, failure_cause
from ms_llm.run.memory import out_of_memory_error

# In a fresh interpreter: the limit is process-wide. 64 MB more than torch holds after import; a
# 256 MB tensor then fails in torch's allocator, and the context manager turns it into our error.
CAPPED = """
import torch
from ms_llm.errors import OutOfMemory
from ms_llm.run.memory import data_memory_bytes, limit_host_memory, out_of_memory_error
limit = limit_host_memory(0.0625)
assert limit - data_memory_bytes() < 0.07 * 2**30
small = torch.ones(2**20)                       # 4 MB fit
try:
    with out_of_memory_error(0.0625, 3, 6):
        torch.ones(2**26)                       # 256 MB do not
except OutOfMemory as exc:
    print(exc)
"""


def test_the_limit_caps_the_process_and_the_error_is_one_line():
    proc = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("rank 3 ran out of memory in step 7 under train.memory_limit_gb = 0.0625 "
                           "(DefaultCPUAllocator: can't allocate memory: you tried to allocate 268435456 bytes); "
                           "raise train.memory_limit_gb, split the sequence over more ranks (strategy.cp)"), line


def test_other_errors_pass_through_and_out_of_memory_is_not_retried():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with out_of_memory_error(1.0, 0, 0):
            raise RuntimeError("shape mismatch")
    with pytest.raises(OutOfMemory, match="under this machine's memory"):
        with out_of_memory_error(0.0, 0, 0):
            raise MemoryError()
    assert failure_cause(OutOfMemory("rank 0 ran out of memory")) == "out_of_memory"
    assert "out_of_memory" in DETERMINISTIC           # the same limit fails the same step again
