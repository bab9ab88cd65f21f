"""A stopping instance hands its streams to another only when one answers discovery
($SRV.STATS). On a loaded host a busy peer answers late: the instances seen lately get
PEER_PATIENCE_S to answer, the rest GATHER_S, and a peer that answers "closing" ends the wait."""

import asyncio
import json
import time

import nats
from kvpager.services.connection import flush_sent
from kvpager.services.discovery import SCHEDULER_STATS
from kvpager.services.scheduler.drain import GATHER_S, other_instances

PREFIX = "llm"


def _stats(instance: str, closing: bool = False, prefix: str = PREFIX) -> bytes:
    load = {"model": "tiny", "role": "both", "closing": closing}
    metadata = {"prefix": prefix, "instance": instance}
    return json.dumps({"metadata": metadata, "endpoints": [{"data": load}]}).encode()


async def _peer(nc, answer: bytes, delay_s: float, seen: list) -> None:
    """Another scheduler, as discovery sees it: it answers after `delay_s`."""

    async def respond(msg) -> None:
        seen.append(round(time.monotonic(), 3))  # when each request came: in a failure's message
        await asyncio.sleep(delay_s)
        await nc.publish(msg.reply, answer)

    await nc.subscribe(SCHEDULER_STATS, cb=respond)
    await flush_sent(nc)  # nc.flush() can come back before the server has the SUB


async def _look(url: str, peers: list[tuple[bytes, float]], expect: frozenset, patience_s: float):
    """(instances found, seconds taken, [start, when the peers heard each request])"""
    peer_nc, nc = await nats.connect(url), await nats.connect(url)
    seen: list[float] = []
    try:
        for answer, delay_s in peers:
            await _peer(peer_nc, answer, delay_s, seen)
        start = time.monotonic()
        found = await other_instances(nc, PREFIX, "me", expect=expect, patience_s=patience_s)
        return found, time.monotonic() - start, [round(start, 3), *seen]
    finally:
        await nc.close()
        await peer_nc.close()


async def test_a_peer_seen_lately_gets_time_to_answer(nats_server):
    found, took, seen = await _look(nats_server.url, [(_stats("b"), 1.0)], frozenset({"b"}), 3.0)
    assert found == {"b"} and 1.0 <= took < 3.0, (found, took, seen)


async def test_an_unknown_late_peer_is_not_waited_for(nats_server):
    found, took, seen = await _look(nats_server.url, [(_stats("b"), 1.0)], frozenset(), 3.0)
    assert found == set() and GATHER_S <= took < 1.0, (found, took, seen)
    assert len(seen) == 2, seen  # the peer was asked: not waited for, not missed


async def test_a_closing_peer_ends_the_wait(nats_server):
    """Every instance of a whole `kvpager serve` stops at once: none takes streams, and no
    instance waits out the patience for the others."""
    peers = [(_stats("b", closing=True), 0.0), (_stats("me"), 0.0), (_stats("x", prefix="y"), 0.0)]
    found, took, seen = await _look(nats_server.url, peers, frozenset({"b"}), 3.0)
    assert found == set() and took < 1.0, (found, took, seen)
    assert len(seen) == 1 + len(peers), seen  # every peer was asked


async def test_a_peer_gone_for_good_costs_the_patience_only(nats_server):
    found, took, _ = await _look(nats_server.url, [], frozenset({"b"}), 1.0)
    assert found == set() and 1.0 <= took < 2.0, (found, took)


async def test_malformed_answers_are_ignored(nats_server):
    """Trust nothing from the wire: a bad answer is no instance, and no crash of the stop."""
    metadata = {"prefix": PREFIX, "instance": "z"}
    bad = [
        b"not json",
        b"[1, 2]",
        json.dumps({"metadata": [], "endpoints": []}).encode(),
        json.dumps({"metadata": metadata, "endpoints": {"data": {}}}).encode(),
        json.dumps({"metadata": metadata, "endpoints": [1]}).encode(),
        json.dumps({"metadata": metadata, "endpoints": [{"data": [1]}]}).encode(),
    ]
    peers = [(answer, 0.0) for answer in bad] + [(_stats("b"), 0.0)]
    found, _, _ = await _look(nats_server.url, peers, frozenset(), 3.0)
    assert found == {"b"}, found
