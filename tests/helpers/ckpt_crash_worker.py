"""A trainer stand-in for the crash tests: `python ckpt_crash_worker.py ROOT SHM|- STEPS`.

Saves a ~8 MB state at steps 1..STEPS (the last save's disk write throttled to 4 MB/s, so
it is still persisting when the test kills this process), printing a marker line after
each snapshot and once the memory tier holds the last step. Then waits to be killed."""
import sys
import time
from pathlib import Path

import numpy as np

from ms_llm.checkpoint import CheckpointWriter, Piece, Region, SaveItem
from ms_llm.run.memory_tier import MemoryTier

SHAPE = (512, 4096)


def state(step: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal(SHAPE, dtype=np.float32)


def main() -> None:
    root, shm, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    memory = MemoryTier(Path(shm), ttl_s=600) if shm != "-" else None
    writer = CheckpointWriter(root, 0, 1, session="crash", memory=memory)
    piece = Piece("w", SHAPE, Region((0, 0), SHAPE))
    for step in range(1, steps + 1):
        if step == steps:
            writer.max_bytes_per_s = 4e6
        writer.save(step, [SaveItem(piece, state(step))], state={"step": step})
        print(f"snapshot {step}", flush=True)
        if step < steps:
            writer.wait()
    while memory is not None and (memory.latest() is None or memory.latest().name != f"step_{steps:08d}"):
        time.sleep(0.01)
    print("memory committed", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
