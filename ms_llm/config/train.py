"""TrainConfig: batch, optimizer, schedule, checkpoint policy and data source of a job."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from ms_llm.config.model import MAX_SEQ
from ms_llm.config.schema import spec
from ms_llm.errors import ConfigError

# Upper bounds far past any real job; they turn a typo (1e308) into an error that names the field.
MAX_STEPS = 10 ** 9
MAX_BATCH = 1 << 24


def decays(shape: tuple[int, ...], weight_decay_1d: bool) -> bool:
    """Every parameter decays, or with weight_decay_1d false only those of 2+ dimensions (a norm
    weight or a bias stays 1-D under any tensor-parallel or ZeRO split)."""
    return weight_decay_1d or len(shape) > 1


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = spec("adamw", "AdamW for training; SGD exists for bit-exact parity tests.")
    lr: float = spec(3e-4, "Peak learning rate.", ge=0.0, le=10.0)
    weight_decay: float = spec(0.1, "Decoupled weight decay (AdamW).", ge=0.0, le=10.0)
    weight_decay_1d: bool = spec(True, "Decay 1-D parameters (norm weights, biases) too; Megatron-LM, MindFormers "
                                       "and Hugging Face's Trainer exempt them: false.")
    beta1: float = spec(0.9, "Adam beta1.", ge=0.0, le=1.0)
    beta2: float = spec(0.95, "Adam beta2.", ge=0.0, le=1.0)
    eps: float = spec(1e-8, "Adam epsilon.", ge=0.0, le=1.0)
    grad_clip: float = spec(1.0, "Global gradient-norm clip; 0 means off.", ge=0.0, le=1e9)

    def decays(self, shape: tuple[int, ...]) -> bool:
        """Whether weight decay applies to a parameter of this (global or local) shape: the one
        rule every optimizer path follows (torch's param groups, the ZeRO engine, MindSpore's AdamW)."""
        return decays(shape, self.weight_decay_1d)


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    warmup_steps: int = spec(0, "Linear warmup from 0 to lr.", ge=0, le=MAX_STEPS)
    decay: Literal["cosine", "linear", "constant"] = spec("cosine", "Shape after warmup.")
    min_lr_ratio: float = spec(0.1, "Final lr as a fraction of the peak.", ge=0.0, le=1.0)
    warmup_from_zero: bool = spec(False, "The first update runs at rate 0 and update k at lr*(k-1)/warmup_steps "
                                         "during warmup, as Megatron-LM and MindFormers schedule it; false: update "
                                         "k at lr*k/warmup_steps (torchtitan's).")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval: Union[int, Literal["auto"]] = spec(0, "Steps between saves; 0 = never; 'auto' = chosen from "
                                                 "measured save/step time and mtbf_hours.",
                                                 ge=0, le=MAX_STEPS)
    keep_last: int = spec(3, "Checkpoints retained on disk.", ge=1, le=1 << 20)
    async_save: bool = spec(True, "Snapshot to host memory, persist in the background.")
    memory_tier: bool = spec(False, "Also keep the last snapshot in /dev/shm for fast restart.")
    mtbf_hours: float = spec(24.0, "Mean time between failures of the job, for interval='auto'.",
                            ge=1e-3, le=1e6)
    load: str = spec("", "Checkpoint folder a new run starts from. A run folder that holds checkpoints of its "
                         "own resumes from its newest (<run>/checkpoints/latest) either way.")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = spec("stdlib", "'stdlib' = the Python standard library's sources, byte-tokenized; "
                                 "or a path to a uint16/uint32 token file.")
    token_dtype: Literal["uint16", "uint32"] = spec("uint16", "Element type of a token file.")
    paths: tuple[str, ...] = spec((), "Indexed dataset prefixes (PREFIX.bin + PREFIX.idx, Megatron's format, as "
                                      "`ms-llm prepare-data` writes); when given, `source` is not read.")
    weights: tuple[float, ...] = spec((), "Blend weights, one per path, normalized; empty: each dataset weighs "
                                          "its tokens.", ge=0.0, le=1e12)
    split: str = spec("969,30,1", "Train,valid,test shares of each dataset's documents (Megatron's --split).")
    tokenizer: str = spec("", "The tokenizer the data was made with (recorded; prepare-data writes it beside "
                              "the data).")

    def __post_init__(self) -> None:
        if self.weights and len(self.weights) != len(self.paths):
            raise ConfigError(f"train.data.weights: {len(self.weights)} weights for {len(self.paths)} paths; "
                              "give one weight per path, or none")
        if self.weights and not sum(self.weights) > 0:
            raise ConfigError("train.data.weights: all weights are 0; give at least one a positive weight")
        self.split_fractions()

    def split_fractions(self) -> tuple[float, float, float]:
        """'969,30,1' -> normalized (train, valid, test); missing parts are 0 (Megatron's parse)."""
        try:
            parts = [float(p) for p in self.split.split(",")]
        except ValueError:
            parts = []
        if not 1 <= len(parts) <= 3 or any(not 0 <= p < float("inf") for p in parts) or sum(parts) <= 0:
            raise ConfigError(f"train.data.split: got {self.split!r}; give up to three non-negative train,valid,test "
                              "shares with a positive sum, e.g. '969,30,1'")
        parts += [0.0] * (3 - len(parts))
        total = sum(parts)
        return parts[0] / total, parts[1] / total, parts[2] / total


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    interval: int = spec(0, "Steps between validation losses (and after the last step); 0 = off. Needs "
                            "train.data.paths with a valid share in train.data.split.", ge=0, le=MAX_STEPS)
    batches: int = spec(1, "Global batches of the valid split per evaluation, the same ones every time.", ge=1,
                        le=1 << 20)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    global_batch_size: int = spec(8, "Sequences per optimizer step, over all data-parallel ranks.", ge=1,
                                  le=MAX_BATCH)
    micro_batch_size: int = spec(1, "Sequences per forward pass on one rank.", ge=1, le=MAX_BATCH)
    seq_len: int = spec(128, "Tokens per sequence.", ge=2, le=MAX_SEQ)
    steps: int = spec(10, "Optimizer steps.", ge=0, le=MAX_STEPS)
    seed: int = spec(1234, "Seeds weights, data order and dropout.", ge=0, le=2 ** 32 - 1)
    log_every: int = spec(1, "Steps between progress lines.", ge=1, le=MAX_STEPS)
    memory_limit_gb: float = spec(0.0, "Memory each worker may allocate for its training steps (gradients, optimizer "
                                       "state, activations), GB; 0 = no limit. On a host: RLIMIT_DATA at what the "
                                       "worker holds once its model is built, plus this; torch on GPU: its "
                                       "allocator's cap. A step that needs more stops with one line naming this "
                                       "limit.", ge=0.0, le=1e6)
    compile: bool = spec(False, "torch backend: torch.compile each decoder layer (MindSpore compiles its graph "
                                "anyway).")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"doc": "Optimizer."})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"doc": "Learning-rate schedule."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoint policy."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Token source."})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"doc": "Validation loss."})
