"""Typed errors raised at kvpager's edges (requests, configuration, checkpoints), and
`ErrorType`, every `ErrorInfo.type` a client can see: the classes' types and the few that
only a stream's end says (no exception carries them).

A leaf module: it imports nothing of ours, so every package may raise these.
"""

from typing import Literal


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


class KvTransferError(KvpagerError):
    """KV blocks could not move between executors (peer gone, timed out, caches that do not
    match): the request falls back to recomputing its prompt."""

    type = "kv_transfer_failed"


# A stream ends with these without an exception: its deadline passed (the tokenizer aborts it),
# its instance failed more often than `--migration-limit` allows (services/tokenizer/
# dispatch.py), or the Python client lost its NATS connection or heard nothing for too long.
STREAM_END_TYPES = ("deadline_exceeded", "migration_failed", "connection_lost")


def _error_classes(cls: type[KvpagerError] = KvpagerError) -> list[type[KvpagerError]]:
    """`cls` and every subclass defined here (services' own subclasses reuse these types)."""
    return [cls] + [sub for child in cls.__subclasses__() for sub in _error_classes(child)]


ERROR_TYPES = tuple(dict.fromkeys([cls.type for cls in _error_classes()] + [*STREAM_END_TYPES]))
ErrorType = Literal[ERROR_TYPES]  # the JSON schema's enum of ErrorInfo.type
