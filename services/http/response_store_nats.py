"""Stored responses in NATS JetStream's key-value store (`--responses-store nats`): they outlive
a gateway's restart, and every gateway on the same NATS shares them, so a conversation goes on
through whichever replica a load balancer picks.

One bucket, `<prefix>_responses`, whose stream the gateway creates with the store's bounds:
at most `--responses-max-stored` entries and `--responses-max-bytes`, the oldest dropped first
(`discard: old`, where a default KV bucket refuses new writes), each kept `--responses-ttl`
seconds. Each value names its owner (the API key's cache salt), checked on every read as in
memory; the per-key share is not enforced here. The gateway identity may use this bucket's
subjects alone (services/credentials.py).
"""

import asyncio
import re

import msgspec
import nats.js.errors
import structlog
from kvpager.services.http.errors import HttpError
from kvpager.services.http.response_store import StoredResponse
from kvpager.services.subjects import responses_bucket
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

log = structlog.get_logger(__name__)

_KEY = re.compile(r"^[-_=a-zA-Z0-9]{1,128}$")  # a JetStream key, no dots (one token)


class _Record(msgspec.Struct):
    owner: str
    stored: StoredResponse


class NatsResponseStore:
    """The same interface as ResponseStore, over one JetStream KV bucket."""

    def __init__(
        self, nc: NATS, prefix: str, max_entries: int, max_bytes: int, ttl_s: float
    ) -> None:
        self.bucket = responses_bucket(prefix)
        self._nc = nc
        self._config = StreamConfig(
            name=f"KV_{self.bucket}",
            subjects=[f"$KV.{self.bucket}.>"],
            max_msgs=max_entries,
            max_bytes=max_bytes,
            max_age=ttl_s,
            max_msgs_per_subject=1,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            allow_rollup_hdrs=True,
            deny_delete=True,
            allow_direct=True,
        )
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> bool:
        if not _KEY.match(response_id):
            return False
        kv = await self._bucket()
        try:
            await kv.put(response_id, msgspec.json.encode(_Record(owner, stored)))
        except (nats.errors.Error, nats.js.errors.Error) as exc:  # e.g. over max_payload
            log.warning("response not stored", response_id=response_id, error=repr(exc))
            return False
        return True

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        if not _KEY.match(response_id):
            return None
        kv = await self._bucket()
        try:
            entry = await kv.get(response_id)
        except nats.js.errors.KeyNotFoundError:  # unknown, deleted or expired
            return None
        if entry.value is None:
            return None
        record = msgspec.json.decode(entry.value, type=_Record)
        return record.stored if record.owner == owner else None

    async def delete(self, owner: str, response_id: str) -> bool:
        if await self.get(owner, response_id) is None:
            return False
        await (await self._bucket()).delete(response_id)
        return True

    async def _bucket(self) -> KeyValue:
        """The bucket, its stream created (or its bounds updated) on first use; a 503 when
        the server has no JetStream (or the gateway may not use it)."""
        async with self._lock:
            if self._kv is None:
                try:
                    self._kv = await self._create()
                except (nats.errors.Error, nats.js.errors.Error) as exc:
                    message = f"the response store (NATS JetStream) is unavailable: {exc!r}"
                    raise HttpError(503, message, "unavailable") from exc
            return self._kv

    async def _create(self) -> KeyValue:
        js = self._nc.jetstream()
        try:
            await js.add_stream(self._config)
        except nats.js.errors.BadRequestError:  # there, with other bounds
            await js.update_stream(self._config)
        return await js.key_value(self.bucket)
