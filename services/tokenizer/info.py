"""The scheduler's SchedulerInfo, and the public Health and ModelList a tokenizer builds on it."""

import msgspec
import nats.errors
from kvpager.schemas.public import Health, ModelCard, ModelList
from kvpager.schemas.scheduler import SchedulerInfo
from kvpager.services.settings import Settings
from nats.aio.client import Client as NATS

INFO_TIMEOUT_S = 2.0


async def scheduler_info(nc: NATS, subject: str) -> SchedulerInfo | None:
    """The scheduler's answer, or None when no scheduler answers."""
    try:
        reply = await nc.request(subject, b"", timeout=INFO_TIMEOUT_S)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return None
    return msgspec.msgpack.decode(reply.data, type=SchedulerInfo)


def health(info: SchedulerInfo | None, settings: Settings) -> Health:
    if info is None:
        return Health("unavailable", settings.instance, settings.model, "no scheduler answers")
    if not info.executor_attached:
        message = "the scheduler waits for its executor"
        return Health("unavailable", settings.instance, settings.model, message)
    return Health("ok", settings.instance, info.model)


def models(info: SchedulerInfo | None, settings: Settings) -> ModelList:
    if info is None or not info.executor_attached:
        return ModelList([])
    card = ModelCard(info.model, settings.instance, info.max_model_len, info.vocab_size)
    return ModelList([card])
