"""One folder per run: launcher and worker logs, metrics.jsonl, the resolved config, checkpoints.

    runs/<name>-<YYYYmmdd-HHMMSS>/
        config.yaml        the job as resolved (dp, micro-batches filled in)
        launcher.log       what the launcher (torchrun / msrun) printed
        logs/              one log per worker
        metrics.jsonl      one JSON object per logged step (rank 0)
        checkpoints/       step-N folders and the `latest` pointer
        heartbeat/         one liveness file per rank (ms_llm.run.heartbeat)
        data/              the tokenized default corpus cache
        compile_cache/     MindSpore's compiled graphs, one folder per job, world and version
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ms_llm.errors import RunFolderError


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @classmethod
    def create(cls, name: str, run_dir: str | Path | None = None, base: str | Path = "runs") -> "RunFolder":
        root = Path(run_dir) if run_dir else Path(base) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        folder = cls(root.resolve())
        try:
            for sub in (folder.logs, folder.checkpoints, folder.data):
                sub.mkdir(parents=True, exist_ok=True)
            folder.probe_write()
        except OSError as exc:
            raise RunFolderError(f"run folder {folder.root}: cannot write there ({exc.strerror or exc}); "
                                 "pick another --run-dir or free space") from None
        return folder

    def probe_write(self) -> None:
        """Write, fsync and remove a small file: a read-only or full disk fails here, before the
        workers start, rather than in the middle of a run."""
        probe = self.root / f".write_probe.{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def heartbeat(self) -> Path:
        return self.root / "heartbeat"

    @property
    def compile_cache(self) -> Path:
        return self.root / "compile_cache"

    @property
    def launcher_log(self) -> Path:
        return self.root / "launcher.log"
