"""NATS service discovery: every kvpager process registers with the NATS services framework
(`nats.micro`), so `nats micro ls | info | stats` and the `$SRV.PING | INFO | STATS` requests
list it, with its endpoints and their request counts.

nats.micro cannot adopt a subscription made before: an endpoint replaces it, running the same
callback on the same subject. It always subscribes in a queue group, so a subject that every
instance must hear (llm.stats, the scheduler's internal subjects) gets a group of its own per
process; a group of one member receives every message, as a plain subscription does.
"""

import json
import os
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from kvpager.services.settings import Settings
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service

MsgHandler = Callable[[Msg], Awaitable[None]]
SCHEDULER_STATS = "$SRV.STATS.kvpager-scheduler"  # every scheduler answers with its load


def _version() -> str:
    try:
        return metadata.version("kvpager")
    except metadata.PackageNotFoundError:
        return "0.0.0"


class Discovery:
    """One process's registration: `kvpager-<kind>`, metadata naming its instance."""

    def __init__(self, service: Service, kind: str) -> None:
        self.service = service
        self.own_queue = f"kvpager-{kind}-{service.id}"  # this process alone

    @classmethod
    async def register(
        cls,
        nc: NATS,
        kind: str,
        settings: Settings,
        description: str,
        stats: Callable[[], Any] | None = None,
        **details: str,
    ) -> "Discovery":
        """`stats`: what `$SRV.STATS` carries as every endpoint's `data` (JSON-ready)."""
        # the pid lets `kvpager serve` tell which of its children stopped answering $SRV.PING
        info = {
            "instance": settings.instance,
            "prefix": settings.prefix,
            "pid": str(os.getpid()),
            **details,
        }
        service = await add_service(
            nc,
            name=f"kvpager-{kind}",
            version=_version(),
            description=description,
            metadata=info,
            stats_handler=None if stats is None else lambda _endpoint: stats(),
        )
        return cls(service, kind)

    @property
    def id(self) -> str:
        return self.service.id

    async def subscribe(
        self, name: str, subject: str, callback: MsgHandler, queue: str | None = None
    ) -> None:
        """`callback` on `subject` as the endpoint `name`; in `queue`, or heard by this
        process whatever the others do (no queue given)."""

        async def handle(request: Request) -> None:
            # The callbacks stream to the reply subject, which Request does not expose.
            await callback(request._msg)

        await self.service.add_endpoint(
            name=name, subject=subject, queue_group=queue or self.own_queue, handler=handle
        )

    async def stop(self) -> None:
        """Unsubscribe every endpoint and leave discovery (draining: no new work comes)."""
        await self.service.stop()


def scheduler_answer(data: bytes, prefix: str) -> tuple[str, Any] | None:
    """(instance, its endpoint data) from one scheduler's $SRV.STATS answer under `prefix`;
    None for another prefix's, or for anything malformed (trust nothing from the wire)."""
    try:
        stats = json.loads(data) if data else None  # empty: "no responders"
    except ValueError:
        return None
    if not isinstance(stats, dict) or not isinstance(stats.get("metadata"), dict):
        return None
    metadata, endpoints = stats["metadata"], stats.get("endpoints")
    name = metadata.get("instance")
    if metadata.get("prefix") != prefix or not isinstance(name, str) or not name:
        return None
    if not isinstance(endpoints, list) or not endpoints or not isinstance(endpoints[0], dict):
        return None
    return name, endpoints[0].get("data") or {}
