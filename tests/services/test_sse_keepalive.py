"""The gateway's SSE keepalives (services/http/stream_waits.py: events_after): OpenAI-style
streams get no comment unless `--sse-keepalive` is set, as vLLM's server (vllm bench serve 0.32
drops the event after a comment: it strips the chunk's blank line and glues the two); with it
set, a comment marks each silent stretch. The stream here is a queue of timed events, the
shape Streams.next has (no NATS)."""

import asyncio

import pytest
from kvpager.schemas.errors import ConfigError
from kvpager.services.http.settings import HttpSettings
from kvpager.services.http.stream_waits import events_after


class TimedEvents:
    """Streams.next's contract: an event, None at the end, TimeoutError after `timeout`."""

    def __init__(self, keepalive_s: float | None, gaps_s: list[float]) -> None:
        self.keepalive_s = keepalive_s
        self._items = asyncio.Queue()
        asyncio.get_running_loop().create_task(self._feed(gaps_s))

    async def _feed(self, gaps_s: list[float]) -> None:
        for index, gap in enumerate(gaps_s):
            await asyncio.sleep(gap)
            self._items.put_nowait((0, index))
        self._items.put_nowait(None)

    async def next(self, timeout: float | None = None):
        return await asyncio.wait_for(self._items.get(), timeout)


async def _collect(keepalive_s: float | None, gaps_s: list[float]) -> list:
    return [item async for item in events_after(TimedEvents(keepalive_s, gaps_s), None)]


def test_no_keepalive_by_default():
    assert HttpSettings().sse_keepalive == 0.0
    got = asyncio.run(_collect(None, [0.3, 0.0]))
    assert got == [(0, 0), (0, 1)]


def test_a_silent_stretch_gets_keepalives_when_asked():
    got = asyncio.run(_collect(0.1, [0.35, 0.0]))
    assert got[-2:] == [(0, 0), (0, 1)]
    assert 2 <= got.count(None) <= 3 and set(got[:-2]) == {None}


def test_a_negative_keepalive_is_refused():
    with pytest.raises(ConfigError, match="sse_keepalive"):
        HttpSettings(sse_keepalive=-1.0)
