"""The error types users see. Each message names the offending field and a fix."""


class MsLlmError(ValueError):
    """Base class: a problem with the user's input, reported without a deep traceback."""


class ConfigError(MsLlmError):
    """A config file or value is malformed: unknown key, wrong type, out of range, missing."""


class StrategyError(MsLlmError):
    """A parallel strategy that cannot run with this model, batch or world size."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


class CheckpointError(MsLlmError):
    """A checkpoint that cannot be read as asked: missing, corrupted, truncated or incompatible.
    The message names the folder or file and the tensor."""


class TrainingDiverged(MsLlmError):
    """The loss or gradient norm stopped being finite. The message names the step and the last
    checkpoint saved before it, which is kept."""


class RunFolderError(MsLlmError):
    """A run folder that cannot be created or written: missing parent, read-only, or full.
    The message names the folder and the operating system's reason."""


class OutOfMemory(MsLlmError):
    """A step needed more memory than its rank has (train.memory_limit_gb, or the machine's).
    The message names the limit and what to change."""
