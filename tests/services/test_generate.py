"""Generation through tokenizer, scheduler and executor equals the offline engine.LLM."""

import asyncio

import pytest
from kvpager.engine import LLM, SamplingParams
from kvpager.services.client import Client

from tests.models import CORPUS

NUM_STREAMS = 24


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), seed=0)


def _prompts() -> list[str]:
    """Different lengths, non-ASCII among them, some long enough to travel in pieces."""
    prompts = []
    for i in range(NUM_STREAMS):
        text = CORPUS[i % 6]
        prompts.append(" ".join([text] * (1 + i % 4))[: 20 + 37 * i])
    return prompts


def _max_tokens(i: int) -> int:
    return 1 + (i * 11) % 64


async def collect(stream) -> list:
    events = [event async for event in stream]
    assert [event.seq for event in events] == list(range(len(events))), "seq has gaps"
    num_samples = len({event.index for event in events})  # one final event each
    assert sum(event.is_final for event in events) == num_samples and events[-1].is_final
    return events


def _text(events) -> str:
    return "".join(event.text for event in events)


def _token_ids(events) -> list[int]:
    return [token_id for event in events for token_id in event.token_ids]


async def test_concurrent_streams_equal_offline(client: Client, offline: LLM):
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=_max_tokens(i)) for i in range(NUM_STREAMS)
    ]
    expected = offline.generate(prompts, params, use_tqdm=False)
    streams = [
        client.generate(prompt=p, temperature=0.0, max_tokens=sp.max_tokens)
        for p, sp in zip(prompts, params)
    ]
    results = await asyncio.gather(*(collect(stream) for stream in streams))
    for events, want in zip(results, expected):
        completion = want.outputs[0]
        assert _token_ids(events) == completion.token_ids
        assert _text(events) == completion.text
        assert events[-1].finish_reason == completion.finish_reason
        usage = events[-1].usage
        assert usage.num_prompt_tokens == len(want.prompt_token_ids)
        assert usage.num_completion_tokens == len(completion.token_ids)
    stats = await client.stats()
    assert stats.num_preemptions > 0, "the cache is small enough to preempt"
    assert stats.num_generated_tokens > 0 and stats.ttft_ms.count > 0


async def test_non_ascii_text_streams_whole_characters(client: Client, offline: LLM):
    prompt = "naïve café déjà vu — 日本語のテキスト, emoji 🎉🚀"
    want = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[
        0
    ].outputs[0]
    events = await collect(client.generate(prompt=prompt, temperature=0.0, max_tokens=48))
    assert _text(events) == want.text
    assert _token_ids(events) == want.token_ids


async def test_chat_messages(client: Client, offline: LLM):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a paged KV cache?"},
    ]
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    events = await collect(client.generate(messages=messages, temperature=0.0, max_tokens=24))
    assert _token_ids(events) == want.outputs[0].token_ids
    assert _text(events) == want.outputs[0].text
    assert events[-1].usage.num_prompt_tokens == len(want.prompt_token_ids)


async def test_stop_string_ends_the_stream(client: Client, offline: LLM):
    prompt = CORPUS[1]
    full = (
        offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    stop = full[12:15]
    assert len(stop) == 3 and full.find(stop) >= 5
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
    want = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    events = await collect(
        client.generate(prompt=prompt, temperature=0.0, max_tokens=40, stop=stop)
    )
    assert _text(events) == want.text == full[: full.find(stop)]
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop


async def test_stream_false_sends_one_final_event(client: Client, offline: LLM):
    want = offline.generate(
        CORPUS[3], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False
    )[0].outputs[0]
    events = await collect(
        client.generate(prompt=CORPUS[3], temperature=0.0, max_tokens=20, stream=False)
    )
    assert len(events) == 1
    assert events[0].text == want.text and events[0].token_ids == want.token_ids
    assert events[0].finish_reason == "length"


async def test_msgpack_request_and_long_prompt_in_pieces(client: Client, offline: LLM):
    prompt_ids = [(7 * i) % 300 + 3 for i in range(700)]  # 11 pieces of 64 ids, both hops
    want = offline.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )[0].outputs[0]
    events = await collect(
        client.generate(prompt_token_ids=prompt_ids, temperature=0.0, max_tokens=8, msgpack=True)
    )
    assert _token_ids(events) == want.token_ids
    assert events[-1].usage.num_prompt_tokens == 700


async def test_prefix_cache_hits_are_reported(client: Client):
    prompt = " ".join(CORPUS[:3])  # over three full blocks
    first = await collect(client.generate(prompt=prompt, temperature=0.0, max_tokens=2))
    second = await collect(client.generate(prompt=prompt, temperature=0.0, max_tokens=2))
    assert _token_ids(first) == _token_ids(second)
    assert second[-1].usage.num_cached_prompt_tokens >= 3 * 16
    assert (await client.stats()).prefix_cache_hit_rate > 0


async def test_sampling_with_seed_and_logprobs(client: Client):
    fields = dict(prompt=CORPUS[0], temperature=0.8, top_k=20, seed=1234, max_tokens=12, logprobs=3)
    first = await collect(client.generate(**fields))
    second = await collect(client.generate(**fields))
    assert _token_ids(first) == _token_ids(second)
    logprobs = [lp for event in first for lp in event.logprobs]
    assert [lp.token_id for lp in logprobs] == _token_ids(first)
    assert all(len(lp.top_token_ids) == 3 and lp.logprob <= 0.0 for lp in logprobs)


async def test_events_bring_their_tokens_texts(client: Client, offline: LLM):
    """Logprob entries, their alternatives and an echoed prompt carry each token's text (the
    gateway shows them and holds no tokenizer), decoded alone with special tokens kept."""

    def text(token_id: int) -> str:
        return offline.tokenizer.decode([token_id], skip_special_tokens=False)

    fields = dict(max_tokens=6, logprobs=2, prompt_logprobs=2, echo=True, stream=False)
    [event] = await collect(client.generate(prompt=CORPUS[1], **fields))
    assert event.prompt_tokens == [text(t) for t in event.prompt_token_ids]
    assert event.prompt_logprobs[0] is None  # the first prompt token has none
    entries = event.logprobs + event.prompt_logprobs[1:]
    assert len(entries) == 6 + len(event.prompt_token_ids) - 1
    for lp in entries:
        assert lp.token == text(lp.token_id)
        assert lp.top_tokens == [text(t) for t in lp.top_token_ids]


async def test_health_models_and_stats(client: Client, tiny_llama):
    health = await client.health()
    assert health.status == "ok" and health.instance == "default"
    models = await client.models()
    assert [m.max_model_len for m in models.models] == [1024]
    stats = await client.stats()
    assert stats.num_blocks == 48 and stats.block_size == 16


async def test_parallel_samples_equal_offline(client: Client, offline: LLM):
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, stop=["e"])
    want = offline.generate(CORPUS[4], params, use_tqdm=False)[0].outputs
    events = await collect(
        client.generate(prompt=CORPUS[4], n=3, temperature=0.9, seed=7, max_tokens=12, stop="e")
    )
    for index, completion in enumerate(want):
        sample = [event for event in events if event.index == index]
        assert _token_ids(sample) == completion.token_ids, index
        assert _text(sample) == completion.text, index
        finals = [event for event in sample if event.finish_reason is not None]
        assert [e.finish_reason for e in finals] == [completion.finish_reason], index
    assert events[-1].usage.num_completion_tokens == sum(len(c.token_ids) for c in want)
    assert len({tuple(c.token_ids) for c in want}) > 1, "the samples differ"


async def test_beam_search_equals_offline(client: Client, offline: LLM):
    """Each of the n best beams comes whole as one final event, best first, as offline."""
    prompts = [CORPUS[0][:30], CORPUS[3][:50]]
    params = SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=12)
    expected = offline.beam_search(prompts, params, use_tqdm=False)
    streams = [
        client.generate(prompt=p, beam_width=3, n=2, temperature=0.0, max_tokens=12)
        for p in prompts
    ]
    results = await asyncio.gather(*(collect(stream) for stream in streams))
    for events, want in zip(results, expected):
        assert [e.index for e in events] == [0, 1]
        for event, beam in zip(events, want.outputs):
            assert event.token_ids == beam.token_ids and event.text == beam.text
            assert event.finish_reason == beam.finish_reason
            assert event.cumulative_score == pytest.approx(beam.cumulative_score)
        assert events[-1].usage.num_completion_tokens == sum(len(b.token_ids) for b in want.outputs)
    assert (await client.stats()).num_used_blocks == 0


async def test_every_sample_ends_with_usage(client: Client):
    """Each of n samples has one final event carrying the usage so far (vLLM's continuous
    usage); the last has the request's total; the stream ends after all n."""
    fields = dict(prompt=CORPUS[1], n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    for stream in (True, False):
        events = await collect(client.generate(stream=stream, **fields))
        finals = [event for event in events if event.is_final]
        assert sorted(event.index for event in finals) == [0, 1, 2], stream
        assert all(event.finish_reason is not None for event in finals)
        assert events[-1] is finals[-1] and finals[-1].usage.num_completion_tokens == 18
        so_far = [event.usage.num_completion_tokens for event in finals]
        assert so_far == sorted(so_far) and so_far[0] >= 6, so_far
        assert {event.usage.num_prompt_tokens for event in finals} == {
            finals[0].usage.num_prompt_tokens
        }
