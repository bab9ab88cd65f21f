"""Disaggregation's hand-off (no NATS): a prefill engine computes the prompt and the first
token, then hands the stream with its blocks to a decode engine (EngineCore.hand_off with the
prefill instance's rule), which goes on without recomputing the prompt: the same tokens as an
engine that never handed it on, greedy and seeded. A failed transfer recomputes on the decode
engine; two KV groups (Gemma 2's sliding window) and an fp8 cache move too; every block is
free on both sides after. Streams that cannot move (n > 1) stay on the prefill engine."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.core import PREFILLED
from kvpager.engine.frontend.migration import continuation
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.services.scheduler.drain import prefilled

from tests.engine.helpers import assert_all_free, random_prompts
from tests.engine.sched.test_kv_handoff import (
    GREEDY,
    SEEDED,
    Engine,
    _move_bytes,
    _reference,
    _request,
    tiny_gemma2,  # noqa: F401 (a fixture)
)


def _disaggregated(path, params, transfer: str, **overrides):
    """The prefill engine until its first token, then the decode engine."""
    prompt = random_prompts([21], seed=3)[0]
    source, target = Engine(path, **overrides), Engine(path, **overrides)
    source.add(_request(prompt, params))
    source.run_until(lambda: len(source.tokens("r")) >= 1)
    assert source.core.hand_off("p", "prefill-agent", prefilled, PREFILLED) == 1
    source.llm.run_async(source.core.publish())
    final = [d for d in source.deltas if d.kv_handoff is not None]
    assert len(final) == 1 and final[0].kv_handoff.prefilled
    handoff, generated = final[0].kv_handoff, source.tokens("r")
    ids, moved = continuation(prompt, generated, params)
    assert handoff.num_computed_tokens == len(ids) - 1  # the prompt (and any token but the last)
    target.add(_request(ids, moved, kv_import=handoff))
    target.run_until(lambda: bool(target.core.scheduler.importing))
    pull = next(p for s in target.runner.steps for p in s.kv_pulls)
    ok = transfer != "fail"
    num_bytes = _move_bytes(source, target, pull, transfer == "nixl") if ok else 0
    assert target.core.scheduler.pulled(pull.transfer_id, num_bytes, 0.01, ok)
    assert source.core.scheduler.release(pull.transfer_id)
    target.run_until(lambda: target.finished("r"))
    return source, target, generated + target.tokens("r"), len(ids)


TRANSFERS = ["bytes", "fail"] + (["nixl"] if nixl.available() else [])


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_goes_on_from_the_prefilled_blocks(tiny_llama, params, transfer):
    source, target, tokens, num_prompt = _disaggregated(tiny_llama, params, transfer)
    assert tokens == _reference(tiny_llama, params)
    first = next(s for s in target.runner.steps if "r" in s.num_scheduled_tokens)
    # a failed transfer recomputes the whole prompt on the decode engine; else one token
    assert first.num_scheduled_tokens["r"] == (num_prompt if transfer == "fail" else 1)
    stats = target.core.stats("d")
    assert stats.kv_transfer_failed == (transfer == "fail")
    assert (stats.kv_transfer_blocks > 0) == (transfer != "fail")
    assert source.core.stats("p").kv_handoffs == 1
    for engine in (source, target):
        assert_all_free(engine.llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefilled_blocks_of_every_group_and_fp8(tiny_gemma2, kv_cache_dtype):  # noqa: F811
    transfer = "nixl" if nixl.available() else "bytes"
    overrides = dict(kv_cache_dtype=kv_cache_dtype)
    source, target, tokens, _ = _disaggregated(tiny_gemma2, GREEDY, transfer, **overrides)
    assert len(source.llm.scheduler.block_manager.groups) == 2
    assert tokens == _reference(tiny_gemma2, GREEDY, **overrides)
    for engine in (source, target):
        assert_all_free(engine.llm)


def test_parallel_samples_finish_on_the_prefill_engine(tiny_llama):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    engine = Engine(tiny_llama)
    engine.add(_request(random_prompts([21], seed=3)[0], params))
    engine.run_until(lambda: len(engine.tokens("r")) >= 2)
    assert engine.core.hand_off("p", "prefill-agent", prefilled, PREFILLED) == 0
    engine.run_until(lambda: engine.finished("r"))
    assert not any(d.kv_handoff for d in engine.deltas)
    assert len(engine.tokens("r")) == 2 * params.max_tokens
    assert_all_free(engine.llm)


def test_a_stream_taken_back_frees_its_blocks_into_the_prefix_cache(tiny_llama):
    """No decode instance took it: the prefill engine frees the held blocks (uncounted as a
    read handoff) and the stream, admitted again there, finds its prompt cached."""
    prompt = random_prompts([40], seed=3)[0]
    engine = Engine(tiny_llama)
    engine.add(_request(prompt, GREEDY))
    engine.run_until(lambda: len(engine.tokens("r")) >= 1)
    assert engine.core.hand_off("p", "prefill-agent", prefilled, PREFILLED) == 1
    engine.llm.run_async(engine.core.publish())
    handoff = next(d.kv_handoff for d in engine.deltas if d.kv_handoff is not None)
    assert engine.core.scheduler.take_back(handoff.transfer_id)
    assert not engine.core.scheduler.take_back(handoff.transfer_id)  # once
    assert engine.core.stats("p").kv_handoffs == 0
    assert_all_free(engine.llm)
    ids, moved = continuation(prompt, engine.tokens("r"), GREEDY)
    engine.deltas.clear()
    engine.add(_request(ids, moved, stays_here=True))  # as the scheduler service marks it
    engine.run_until(lambda: len(engine.tokens("r")) >= 1)
    # it finishes here: handing it on again would bounce it one token at a time
    assert engine.core.hand_off("p", "prefill-agent", prefilled, PREFILLED) == 0
    engine.run_until(lambda: engine.finished("r"))
    assert engine.core.stats("p").prefix_cache_hit_tokens >= 32  # its full blocks
    assert not any(d.kv_handoff for d in engine.deltas)
    assert_all_free(engine.llm)
