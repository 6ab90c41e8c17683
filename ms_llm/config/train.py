"""TrainConfig: batch, optimizer, schedule, checkpoint policy and data source of a job."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from ms_llm.config.schema import spec


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = spec("adamw", "AdamW for training; SGD exists for bit-exact parity tests.")
    lr: float = spec(3e-4, "Peak learning rate.", ge=0.0)
    weight_decay: float = spec(0.1, "Decoupled weight decay (AdamW).", ge=0.0)
    beta1: float = spec(0.9, "Adam beta1.", ge=0.0, le=1.0)
    beta2: float = spec(0.95, "Adam beta2.", ge=0.0, le=1.0)
    eps: float = spec(1e-8, "Adam epsilon.", ge=0.0)
    grad_clip: float = spec(1.0, "Global gradient-norm clip; 0 means off.", ge=0.0)


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    warmup_steps: int = spec(0, "Linear warmup from 0 to lr.", ge=0)
    decay: Literal["cosine", "linear", "constant"] = spec("cosine", "Shape after warmup.")
    min_lr_ratio: float = spec(0.1, "Final lr as a fraction of the peak.", ge=0.0, le=1.0)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval: Union[int, Literal["auto"]] = spec(0, "Steps between saves; 0 = never; 'auto' = chosen from "
                                                 "measured save/step time and mtbf_hours.")
    keep_last: int = spec(3, "Checkpoints retained on disk.", ge=1)
    async_save: bool = spec(True, "Snapshot to host memory, persist in the background.")
    memory_tier: bool = spec(False, "Also keep the last snapshot in /dev/shm for fast restart.")
    mtbf_hours: float = spec(24.0, "Mean time between failures of the job, for interval='auto'.", ge=0.0)
    load: str = spec("", "Checkpoint folder a new run starts from. A run folder that holds checkpoints of its "
                         "own resumes from its newest (<run>/checkpoints/latest) either way.")

    def __post_init__(self) -> None:
        if isinstance(self.interval, int) and self.interval < 0:
            from ms_llm.errors import ConfigError
            raise ConfigError(f"train.checkpoint.interval: got {self.interval}; use 0 (off), a step count or 'auto'")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = spec("stdlib", "'stdlib' = the Python standard library's sources, byte-tokenized; "
                                 "or a path to a uint16/uint32 token file.")
    token_dtype: Literal["uint16", "uint32"] = spec("uint16", "Element type of a token file.")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    global_batch_size: int = spec(8, "Sequences per optimizer step, over all data-parallel ranks.", ge=1)
    micro_batch_size: int = spec(1, "Sequences per forward pass on one rank.", ge=1)
    seq_len: int = spec(128, "Tokens per sequence.", ge=2)
    steps: int = spec(10, "Optimizer steps.", ge=0)
    seed: int = spec(1234, "Seeds weights, data order and dropout.", ge=0)
    log_every: int = spec(1, "Steps between progress lines.", ge=1)
    compile: bool = spec(False, "torch backend: torch.compile each decoder layer (MindSpore compiles its graph "
                                "anyway).")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"doc": "Optimizer."})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"doc": "Learning-rate schedule."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoint policy."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Token source."})
