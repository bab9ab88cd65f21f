"""Draining an instance: its streams move on, with their KV blocks, to the other instances.

`kvpager drain INSTANCE` asks (DrainInstance on `.scheduler.drain`), and SIGTERM does the same
when another instance is up. The scheduler refuses new requests, lets the steps in flight
come back, then hands every running stream that can move to its tokenizer with a KvHandoff
(EngineCore.hand_off); the tokenizer sends the continuation elsewhere, whose executor reads
the blocks. Streams that cannot move (parallel samples, beams, penalties) finish here.
"""

import asyncio
import json

from kvpager.engine.frontend.migration import can_move
from kvpager.engine.request import Request
from nats.aio.client import Client as NATS

GATHER_S = 0.25
STATS_SUBJECT = "$SRV.STATS.kvpager-scheduler"  # every scheduler answers (services/discovery.py)


def movable(request: Request) -> bool:
    return can_move(request.sampling_params)


async def other_instances(nc: NATS, prefix: str, instance: str) -> set[str]:
    """The other instances under `prefix` that answer discovery now."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: set[str] = set()
    try:
        await nc.publish(STATS_SUBJECT, b"", reply=inbox)
        await asyncio.sleep(GATHER_S)
        while sub.pending_msgs:
            msg = await sub.next_msg(timeout=0.01)
            found |= _instance_of(msg.data, prefix)
    finally:
        await sub.unsubscribe()
    return found - {instance, ""}


def _instance_of(data: bytes, prefix: str) -> set[str]:
    try:
        stats = json.loads(data) if data else {}
    except ValueError:
        return set()
    metadata = stats.get("metadata") or {} if isinstance(stats, dict) else {}
    if metadata.get("prefix") != prefix or not stats.get("endpoints"):
        return set()
    return {str(metadata.get("instance", ""))}
