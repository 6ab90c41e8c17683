"""The error types users see. Each message names what failed (a field, a file, a step) and a fix."""


class MsLlmError(Exception):
    """Base class: reported to the user without a deep traceback."""


class InputError(MsLlmError, ValueError):
    """A problem with the user's input; a ValueError too, as Python's own errors for bad values are."""


class ConfigError(InputError):
    """A config file or value is malformed: unknown key, wrong type, out of range, missing."""


class StrategyError(InputError):
    """A parallel strategy that cannot run with this model, batch or world size."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


class CheckpointError(InputError):
    """A checkpoint that cannot be read as asked: missing, corrupted, truncated or incompatible.
    The message names the folder or file and the tensor."""


class RunFolderError(InputError):
    """A run folder that cannot be created or written: missing parent, read-only, or full.
    The message names the folder and the operating system's reason."""


class TrainingDiverged(MsLlmError):
    """The loss or gradient norm stopped being finite (with dynamic loss scaling: even at the
    smallest scale). A failure of the run, not of its input. The message names the step and
    what to lower or raise; checkpoints saved before that step are kept."""


class OutOfMemory(MsLlmError):
    """A step needed more memory than its rank has (train.memory_limit_gb, or the machine's).
    A failure of the run, not of its input. The message names the limit and what to change."""
