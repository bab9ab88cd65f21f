"""AsyncKvMoves (engine/async_kv.py) over real NIXL: a prefill engine runs a prompt to its
first token and holds its blocks (Request.hold_kv); a decode engine reads all of them but the
last token's, computes that one and streams on. The stream equals offline greedy, the read
frees the prefill's blocks (its notification), and a read that fails recomputes with no
block held on either side. This is what `kvpager dynamo --disaggregation-mode` runs."""

import asyncio
import time

import pytest
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.async_kv import AsyncKvMoves
from kvpager.engine.config import EngineConfig
from kvpager.engine.llm import LLM
from kvpager.engine.request import Request
from kvpager.engine.sched.kv_moves import HOLD_S
from kvpager.engine.worker.kv_transfer.endpoint import executor_regions
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.dynamo.disagg import all_but_last

nixl = pytest.importorskip("kvpager.engine.worker.kv_transfer.nixl")
if not nixl.available():
    pytest.skip("the nixl extra is not installed", allow_module_level=True)

CONFIG = dict(block_size=16, num_blocks=32)
PROMPT = [5, 6, 7, 8, 9] * 7 + [40, 41]  # 37 tokens: 3 blocks, the last one partly filled
PARAMS = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[int]:
    with LLM(str(tiny_llama), **CONFIG) as llm:
        out = llm.generate([PROMPT], SamplingParams(**PARAMS), use_tqdm=False)
        return out[0].outputs[0].token_ids


class Side:
    def __init__(self, path, name: str) -> None:
        self.engine = AsyncEngine(path, EngineConfig(**CONFIG), name, check_invariants=True)
        regions = executor_regions(self.engine.runner.executor)
        self.moves = AsyncKvMoves(self.engine, nixl.NixlTransfer(regions, name, name))

    async def __aenter__(self) -> "Side":
        self.task = asyncio.create_task(self.engine.run())
        self.moves.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.engine.stop()
        await self.task
        self.engine.close()
        self.moves.close()

    @property
    def num_used(self) -> int:
        return self.engine.scheduler.block_manager.num_used_blocks


async def _collect(queue: asyncio.Queue) -> tuple[list[int], str]:
    token_ids = []
    while True:
        delta = await queue.get()
        token_ids += delta.token_ids
        if delta.finish_reason is not None:
            return token_ids, delta.finish_reason


async def _prefill(side: Side, request_id: str):
    request = Request(request_id, PROMPT, SamplingParams(**{**PARAMS, "max_tokens": 1}))
    request.hold_kv = True
    token_ids, finish_reason = await _collect(side.engine.add(request))
    assert finish_reason == "length" and len(token_ids) == 1
    handoff = side.engine.scheduler.take_hold(request_id)
    assert handoff is not None and handoff.num_computed_tokens == len(PROMPT)
    handoff.instance, handoff.agent = side.moves.card.instance, side.moves.card.name
    assert side.num_used == 3  # held for the decode side
    return handoff


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_decode_reads_the_prefill_blocks_and_streams_offline_greedy(tiny_llama, expected):
    async with Side(tiny_llama, "kvp-prefill") as prefill, Side(tiny_llama, "kvp-decode") as decode:
        await decode.moves.connect(prefill.moves.card)
        handoff = await _prefill(prefill, "r1")
        request = Request("r1", PROMPT, SamplingParams(**PARAMS))
        request.kv_import = all_but_last(handoff, 16)
        token_ids, _ = await _collect(decode.engine.add(request))
        assert token_ids == expected
        stats = decode.engine.scheduler.kv_stats
        assert (stats.num_blocks, stats.num_transfers, stats.num_failed) == (3, 1, 0)
        assert stats.num_bytes > 0
        # the read notified the prefill side: its held blocks go free
        await _until(lambda: prefill.num_used == 0)
        assert prefill.engine.scheduler.kv_stats.num_held == 1
        assert decode.num_used == 0
        for side in (prefill, decode):
            side.engine.scheduler.check_invariants()


async def test_a_failed_read_recomputes_and_no_block_stays_held(tiny_llama, expected):
    async with Side(tiny_llama, "kvf-prefill") as prefill, Side(tiny_llama, "kvf-decode") as decode:
        handoff = await _prefill(prefill, "r2")  # the decode side never connected this peer
        request = Request("r2", PROMPT, SamplingParams(**PARAMS))
        request.kv_import = all_but_last(handoff, 16)
        token_ids, _ = await _collect(decode.engine.add(request))
        assert token_ids == expected  # recomputed
        assert decode.engine.scheduler.kv_stats.num_failed == 1
        assert decode.num_used == 0
        # never read: the hold expires
        assert prefill.num_used == 3
        assert len(prefill.engine.scheduler.expire_holds(time.monotonic() + HOLD_S + 1)) == 1
        assert prefill.num_used == 0
        prefill.engine.scheduler.check_invariants()
