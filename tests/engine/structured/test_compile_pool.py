"""The front doors' compile workers: a grammar that crashes llguidance (a real stack
overflow, sent past the size checks) fails that compile alone with a typed error, the pool is
rebuilt and the next compile works; the caller's process never runs llguidance."""

import asyncio
import json
import os
import time

import psutil
import pytest
from kvpager.engine.structured.compile_pool import CompilePool
from kvpager.engine.structured.limits import GrammarLimits
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.sampling import StructuredOutputsParams

from tests.engine.structured.test_limits import lark_chain, patterns_schema, ref_chain


@pytest.fixture(scope="module")
def pool():
    pool = CompilePool(GrammarLimits(compile_timeout=30.0))
    yield pool
    pool.close()


def _crashing() -> list[StructuredOutputsParams]:
    """Grammars whose compile overflows llguidance's stack (SIGSEGV in the worker)."""
    return [
        StructuredOutputsParams(grammar=lark_chain()),
        StructuredOutputsParams(json=json.dumps(ref_chain())),
    ]


def test_a_crash_fails_that_compile_alone(pool):
    pool.check(StructuredOutputsParams(regex="[a-z]+"))  # workers up
    for spec in _crashing():
        restarts = pool.num_restarts
        with pytest.raises(InvalidRequestError, match="crashed the compiler") as caught:
            pool.check(spec)
        assert caught.value.param == f"structured_outputs.{spec.kind}"
        assert pool.num_restarts == restarts + 1
        pool.check(StructuredOutputsParams(choice=["yes", "no"]))  # a fresh pool answers
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        pool.check(StructuredOutputsParams(regex="a(b"))  # a plain error breaks nothing


async def test_awaited_compiles_leave_the_loop_running(pool):
    """A crash among concurrent compiles: the others get their answer (a second try on the
    rebuilt pool), and the event loop ticks throughout."""
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    good = [StructuredOutputsParams(regex=f"[a-z]{{{i}}}") for i in range(1, 4)]
    crash = pool.check_async(_crashing()[0])
    results = await asyncio.gather(
        crash, *(pool.check_async(s) for s in good), return_exceptions=True
    )
    ticker.cancel()
    assert isinstance(results[0], InvalidRequestError), results
    assert results[1:] == [None, None, None], results
    assert ticks > 1


def test_forty_patterns_cost_the_caller_nothing(pool):
    """Past the size checks, the patterns schema is the worker's problem: a typed error (or a
    pass) in seconds, the caller's memory unchanged."""
    me = psutil.Process(os.getpid())
    before = me.memory_info().rss
    started = time.monotonic()
    spec = StructuredOutputsParams(json=json.dumps(patterns_schema()))
    try:
        pool.check(spec)
    except InvalidRequestError as exc:
        assert exc.param == "structured_outputs.json"
    assert time.monotonic() - started < 30.0
    assert me.memory_info().rss - before < 100 << 20
