"""The scheduler's watch over its peers: its executor, and the tokenizers its streams go to.

An executor that is gone (killed: "no responders" at once) or silent for `liveness_timeout`
seconds is lost: every request fails with "executor_unavailable" and the scheduler waits for
an executor to attach. A tokenizer replica that is gone takes its requests with it: they are
aborted, so their blocks are freed. After a reconnect of our own connection a step or its
answer may have been lost, so the executor is dropped too and attaches afresh.
"""

import asyncio
from collections.abc import Callable

import structlog
from kvpager.schemas.public import ErrorInfo
from kvpager.services.liveness import PeerGone, Reconnects, Silence, ping
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects
from nats.aio.client import Client as NATS

log = structlog.get_logger(__name__)


class PeerWatch:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        settings: Settings,
        executor_id: Callable[[], str | None],
        tokenizer_subjects: Callable[[], set[str]],
        lose_executor: Callable[[ErrorInfo], None],
        drop_tokenizer: Callable[[str], None],
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.interval_s = settings.heartbeat_interval
        self.executor_id = executor_id
        self.tokenizer_subjects = tokenizer_subjects
        self.lose_executor = lose_executor
        self.drop_tokenizer = drop_tokenizer
        self.silence = Silence(settings.liveness_timeout)
        self.reconnects = Reconnects(nc)

    def check_reconnect(self) -> None:
        """Call before acting on a message too: whatever came before a reconnect is stale."""
        if self.reconnects.take():
            message = "the scheduler's connection to NATS was interrupted"
            self.lose_executor(ErrorInfo("unavailable", message))

    async def tick(self) -> None:
        self.check_reconnect()
        subjects = self.tokenizer_subjects()
        await asyncio.gather(self._check_executor(), *map(self._check_tokenizer, subjects))

    async def _check_executor(self) -> None:
        executor_id = self.executor_id()
        if executor_id is None:
            self.silence.note(answered=True)
            return
        subject = self.subjects.executor_ping(executor_id)
        try:
            reply = await ping(self.nc, subject, self.interval_s)
        except PeerGone:
            self._lose(executor_id, "the executor stopped")
            return
        if self.silence.note(answered=reply is not None):
            self._lose(executor_id, f"the executor did not answer for {self.silence.limit_s} s")

    def _lose(self, executor_id: str, message: str) -> None:
        if self.executor_id() == executor_id:  # not re-attached while we waited
            self.lose_executor(ErrorInfo("executor_unavailable", message))

    async def _check_tokenizer(self, subject: str) -> None:
        try:
            await ping(self.nc, subject, self.interval_s)
        except PeerGone:
            log.warning("tokenizer replica gone: aborting its requests", subject=subject)
            self.drop_tokenizer(subject)
