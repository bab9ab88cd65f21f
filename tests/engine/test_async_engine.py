"""AsyncEngine (engine/async_engine.py): the core driven on the caller's loop while requests
come and go. Its outputs equal the offline LLM's, and a request released mid-stream is
aborted at once, every block freed."""

import asyncio

import pytest
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.config import EngineConfig
from kvpager.engine.llm import LLM
from kvpager.engine.request import Request
from kvpager.schemas.sampling import SamplingParams

CONFIG = dict(block_size=16, num_blocks=32)
PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], [5, 6, 7, 8, 9] * 7 + [40, 41]]


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[list[int]]:
    with LLM(str(tiny_llama), **CONFIG) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


async def _collect(queue: asyncio.Queue) -> list[int]:
    token_ids = []
    while True:
        delta = await queue.get()
        token_ids += delta.token_ids
        if delta.finish_reason is not None:
            assert delta.finish_reason == "length"
            return token_ids


async def test_concurrent_requests_equal_offline_and_free_every_block(tiny_llama, expected):
    engine = AsyncEngine(tiny_llama, EngineConfig(**CONFIG), check_invariants=True)
    loop_task = asyncio.create_task(engine.run())
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        queues = [engine.add(Request(f"r{i}", p, params)) for i, p in enumerate(PROMPTS)]
        assert await asyncio.gather(*map(_collect, queues)) == expected
        for i in range(len(PROMPTS)):
            assert not engine.release(f"r{i}")  # finished: nothing to abort
        await _until_idle(engine)
    finally:
        engine.stop()
        await loop_task
        engine.close()


async def test_release_mid_stream_aborts_and_frees(tiny_llama):
    engine = AsyncEngine(tiny_llama, EngineConfig(**CONFIG), check_invariants=True)
    loop_task = asyncio.create_task(engine.run())
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        queue = engine.add(Request("long", PROMPTS[0], params))
        for _ in range(3):
            assert (await queue.get()).finish_reason is None
        assert engine.release("long")
        assert engine.scheduler.block_manager.num_used_blocks == 0  # freed at once
        await _until_idle(engine)
        queue = engine.add(
            Request("next", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
        )
        assert len(await _collect(queue)) == 4  # the engine serves on
    finally:
        engine.stop()
        await loop_task
        engine.close()


async def _until_idle(engine: AsyncEngine) -> None:
    """Until the executor has dropped every row, then the block accounting is checked."""
    for _ in range(500):
        if not engine.core.has_work:
            break
        await asyncio.sleep(0.01)
    assert not engine.core.has_work
    engine.scheduler.check_invariants()
    assert engine.scheduler.block_manager.num_used_blocks == 0
