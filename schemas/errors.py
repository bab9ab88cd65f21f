"""Typed errors raised at kvpager's edges (requests, configuration, checkpoints).

A leaf module: it imports nothing of ours, so every package may raise these.
"""


class KvpagerError(Exception):
    """Base class of every error kvpager raises on purpose."""

    type: str = "internal_error"


class InvalidRequestError(KvpagerError, ValueError):
    """A request (prompt or sampling parameters) is invalid; `param` names the field."""

    type = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """Prompt plus max_tokens can never fit in max_model_len or in the whole cache."""

    type = "request_too_long"


class ConfigError(KvpagerError, ValueError):
    """An engine or service setting is invalid."""

    type = "invalid_config"


class CheckpointError(KvpagerError):
    """A model path is missing, is not a checkpoint, or has weights we cannot read."""

    type = "invalid_checkpoint"


class OverloadedError(KvpagerError):
    """The waiting queue is full: the request may succeed later."""

    type = "overloaded"


class NoInstanceError(KvpagerError):
    """No scheduler-and-executor instance can take the request now (none is up, or every one
    that could has failed it already): it may succeed later."""

    type = "unavailable"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model that no instance serves."""

    type = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class MigrationLimitError(KvpagerError):
    """A stream's instance failed more often than `--migration-limit` allows."""

    type = "migration_failed"


class ExecutorUnavailableError(KvpagerError):
    """The executor cannot run steps any more (e.g. a tensor-parallel rank died or hung)."""

    type = "executor_unavailable"


class InvalidStepError(KvpagerError):
    """A step names ids or counts outside what the executor holds, or out of order: it is
    refused whole, and the executor's state stays as it was."""

    type = "invalid_step"


class PoisonedRequestError(InvalidRequestError):
    """The same request crashed a kvpager service twice: `kvpager serve` refuses it for the
    rest of the deployment's life (services/inflight.py)."""
