"""A stream handed from one engine to another with its KV blocks (the drain's core, no NATS):
the same tokens as a run that never moved, the prompt not recomputed on the target, a
failed transfer recomputing instead, and every block free on both sides after. Two KV
groups (Gemma 2: sliding + full) and an fp8 cache included; the bytes move over NIXL when it
is installed, else through the NATS fallback's gather/scatter."""

import asyncio

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.core import EngineCore
from kvpager.engine.frontend.migration import continuation
from kvpager.engine.request import Request
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.engine.worker.kv_transfer.endpoint import executor_regions
from kvpager.engine.worker.kv_transfer.nixl import NixlTransfer

from tests import model_families
from tests.engine.helpers import assert_all_free, make_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True)
MOVE_AFTER = 5  # tokens generated on the first engine


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    return model_families.build_gemma2(tmp_path_factory.mktemp("gemma2"))


class Recorder:
    """The engine's runner, keeping each step it sends (to see its KvPulls and sizes)."""

    def __init__(self, runner) -> None:
        self.runner, self.steps = runner, []

    async def submit(self, step) -> None:
        self.steps.append(step)
        await self.runner.submit(step)

    async def result(self, step_id: int):
        return await self.runner.result(step_id)

    def cancel(self) -> None:
        self.runner.cancel()


class Engine:
    def __init__(self, path, **overrides) -> None:
        self.llm = make_llm(path, **overrides)
        self.deltas = []
        self.runner = Recorder(self.llm.runner)
        self.core = EngineCore(self.llm.scheduler, self.runner, self._publish)

    async def _publish(self, deltas, step_id) -> None:
        self.deltas += deltas

    def tokens(self, request_id: str) -> list[int]:
        return [t for d in self.deltas if d.request_id == request_id for t in d.token_ids]

    def run_until(self, done) -> None:
        async def loop():
            while not done():
                assert await self.core.run_step() or done(), "the engine stopped early"
            self.core.paused = True
            while self.core.num_in_flight:
                await self.core.run_step()
            self.core.paused = False
            await self.core.publish()

        self.llm.run_async(loop())

    def add(self, request: Request) -> None:
        self.core.add(request)

    def finished(self, request_id: str) -> bool:
        return any(d.request_id == request_id and d.finish_reason for d in self.deltas)


def _request(prompt, params, **fields) -> Request:
    return Request(seq_id="r", prompt_token_ids=list(prompt), sampling_params=params, **fields)


def _move_bytes(source: Engine, target: Engine, pull, use_nixl: bool) -> int:
    ours, theirs = (executor_regions(e.llm.runner.executor) for e in (target, source))
    if not use_nixl:  # the fallback's byte path, without NATS
        flat_remote = [b for group in pull.remote for b in group]
        flat_local = [b for group in pull.local for b in group]
        ours.scatter(flat_local, theirs.gather(flat_remote))
        return ours.num_bytes(len(flat_local))
    reader = NixlTransfer(ours, "target", "b")
    holder = NixlTransfer(theirs, pull.agent, "a")
    reader.add_peer(holder.agent())
    num_bytes = asyncio.run(reader.read(pull.agent, pull.remote, pull.local, pull.transfer_id))
    for _ in range(200):  # NIXL's notification reaches the holder shortly after
        if pull.transfer_id in holder.take_notifications():
            break
        asyncio.run(asyncio.sleep(0.01))
    else:
        raise AssertionError("the holder never heard that its blocks were read")
    reader.close(), holder.close()
    return num_bytes


def _hand_off(path, params, transfer: str, **overrides):
    """Generate MOVE_AFTER tokens on A, hand the stream to B, finish there."""
    prompt = random_prompts([21], seed=3)[0]
    source, target = Engine(path, **overrides), Engine(path, **overrides)
    source.add(_request(prompt, params))
    source.run_until(lambda: len(source.tokens("r")) >= MOVE_AFTER)
    assert source.core.hand_off("a", "source-agent", lambda r: True) == 1
    source.llm.run_async(source.core.publish())
    final = [d for d in source.deltas if d.kv_handoff is not None]
    assert len(final) == 1 and final[0].error.type == "unavailable"
    handoff, generated = final[0].kv_handoff, source.tokens("r")
    ids, moved = continuation(prompt, generated, params)
    target.add(_request(ids, moved, kv_import=handoff))
    target.run_until(lambda: bool(target.core.scheduler.importing))
    pull = next(p for s in target.runner.steps for p in s.kv_pulls)
    ok = transfer != "fail"
    num_bytes = _move_bytes(source, target, pull, transfer == "nixl") if ok else 0
    assert target.core.scheduler.pulled(pull.transfer_id, num_bytes, 0.01, ok)
    assert source.core.scheduler.release(pull.transfer_id)
    target.run_until(lambda: target.finished("r"))
    return source, target, generated + target.tokens("r"), len(ids)


def _reference(path, params, **overrides) -> list[int]:
    engine = Engine(path, **overrides)
    engine.add(_request(random_prompts([21], seed=3)[0], params))
    engine.run_until(lambda: engine.finished("r"))
    return engine.tokens("r")


TRANSFERS = ["bytes", "fail"] + (["nixl"] if nixl.available() else [])


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handoff_goes_on_without_recomputing(tiny_llama, params, transfer):
    source, target, tokens, num_prompt = _hand_off(tiny_llama, params, transfer)
    assert tokens == _reference(tiny_llama, params)
    first = next(s for s in target.runner.steps if "r" in s.num_scheduled_tokens)
    # the transferred tokens count as computed: one token left to compute, not the prompt
    expected = num_prompt if transfer == "fail" else 1
    assert first.num_scheduled_tokens["r"] == expected
    stats = target.core.stats("b")
    if transfer == "fail":
        assert stats.kv_transfer_failed == 1 and stats.kv_transfer_blocks == 0
    else:
        assert stats.kv_transfer_blocks > 0 and stats.kv_transfer_bytes > 0
    for engine in (source, target):
        assert_all_free(engine.llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_handoff_every_group_and_fp8(tiny_gemma2, kv_cache_dtype):
    """Two KV groups (a sliding window's NULL entries stay NULL) and an fp8 cache."""
    transfer = "nixl" if nixl.available() else "bytes"
    overrides = dict(kv_cache_dtype=kv_cache_dtype)
    source, target, tokens, _ = _hand_off(tiny_gemma2, GREEDY, transfer, **overrides)
    assert len(source.llm.scheduler.block_manager.groups) == 2
    assert tokens == _reference(tiny_gemma2, GREEDY, **overrides)
    for engine in (source, target):
        assert_all_free(engine.llm)


def test_abort_during_import_frees_after_the_pull(tiny_llama):
    """An aborted request's imported blocks are freed only once the pull ended (the bytes
    may still be landing in them)."""
    prompt = random_prompts([21], seed=3)[0]
    source, target = Engine(tiny_llama), Engine(tiny_llama)
    source.add(_request(prompt, GREEDY))
    source.run_until(lambda: len(source.tokens("r")) >= MOVE_AFTER)
    source.core.hand_off("a", "source-agent", lambda r: True)
    source.llm.run_async(source.core.publish())
    handoff = next(d.kv_handoff for d in source.deltas if d.kv_handoff is not None)
    ids, moved = continuation(prompt, source.tokens("r"), GREEDY)
    target.add(_request(ids, moved, kv_import=handoff))
    target.run_until(lambda: bool(target.core.scheduler.importing))
    assert target.core.finish_early("r", "abort")
    assert target.llm.scheduler.block_manager.num_used_blocks > 0  # held until the pull ends
    assert target.core.scheduler.pulled(handoff.transfer_id, 0, 0.0, True)
    assert source.core.scheduler.expire_holds(float("inf")) == [handoff.transfer_id]
    for engine in (source, target):
        assert_all_free(engine.llm)
