"""Domain errors. Each carries the exit code the CLI boundary uses and an optional hint."""

from __future__ import annotations


class SpecliError(Exception):
    """Base class: a problem the user can act on. Exit code 2 (usage, configuration or I/O)."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(SpecliError):
    """A flag or argument value that cannot work."""


class ModelFileError(SpecliError):
    """A model path that is missing, not a GGUF file, truncated or otherwise unreadable."""


class ModelPackageMissing(SpecliError):
    """The embedded default models need the `models` extra."""


class ContextOverflowError(SpecliError):
    """The prompt does not fit the context window. n_prompt_tokens: its length in tokens, or
    a lower bound where it was refused before tokenizing; n_ctx: the window."""

    def __init__(self, message: str, hint: str | None = None, *, n_prompt_tokens: int = 0,
                 n_ctx: int = 0):
        super().__init__(message, hint)
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class BackendError(SpecliError):
    """llama.cpp refused an operation (decode failure, cache removal refused)."""


class CheckFailed(SpecliError):
    """A check ran and said no: exit code 1."""

    exit_code = 1


class IncompatiblePairError(CheckFailed):
    """Draft and target cannot be paired; `rule` names the rule that failed."""

    def __init__(self, message: str, rule: str, hint: str | None = None):
        super().__init__(message, hint)
        self.rule = rule
