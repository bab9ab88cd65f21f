"""Stream: SampleDeltas to numbered events, stop strings, one final event (no NATS)."""

import msgspec
import pytest
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import PromptLogprobs
from kvpager.schemas.tokenizer import SampleDelta
from kvpager.services.fit import split_rows
from kvpager.services.tokenizer.requests import Prepared
from kvpager.services.tokenizer.streams import Stream
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


def _stream(tokenizer, stream=True, **params) -> Stream:
    prompt = tokenizer.encode("The quick brown fox")
    prepared = Prepared("r", prompt, SamplingParams(**params), stream, None)
    return Stream(prepared, tokenizer, "inbox", msgpack=False)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def test_stop_string_asks_the_scheduler_once_and_ends_on_its_answer(tokenizer):
    stream = _stream(tokenizer, stop=["lazy"])
    ids = _ids(tokenizer, " jumps over the lazy dog.")
    events, finish = [], []
    for token_id in ids:
        new_events, request = stream.on_delta(SampleDelta("r", 0, [token_id]))
        events += new_events
        finish += [request] if request else []
    assert [(f.finish_reason, f.stop_reason) for f in finish] == [("stop", "lazy")]
    assert not stream.done
    final, _ = stream.on_delta(SampleDelta("r", 0, finish_reason="stop", num_cached_tokens=16))
    events += final
    assert "".join(e.text for e in events) == " jumps over the "
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == "lazy"
    assert events[-1].usage.num_cached_prompt_tokens == 16 and stream.done


def test_stream_false_gives_one_event_with_everything(tokenizer):
    stream = _stream(tokenizer, stream=False)
    ids = _ids(tokenizer, " naïve café 🎉")
    events = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        delta = SampleDelta("r", 0, [token_id], finish_reason="length" if last else None)
        events += stream.on_delta(delta)[0]
    assert len(events) == 1 and events[0].seq == 0
    assert events[0].text == " naïve café 🎉" and events[0].token_ids == ids
    assert events[0].usage.num_completion_tokens == len(ids)


def test_abort_for_a_deadline_carries_the_error(tokenizer):
    stream = _stream(tokenizer)
    stream.abort_error = ErrorInfo("deadline_exceeded", "late")
    events, _ = stream.on_delta(SampleDelta("r", 0, finish_reason="abort"))
    assert events[-1].finish_reason == "abort" and events[-1].error.type == "deadline_exceeded"


def test_end_closes_open_samples_with_one_final_event(tokenizer):
    stream = _stream(tokenizer)
    stream.on_delta(SampleDelta("r", 0, [5]))
    events = stream.end(ErrorInfo("unavailable", "gone"))
    assert len(events) == 1 and events[0].is_final and events[0].seq == 1
    assert events[0].finish_reason == "error" and events[0].error.type == "unavailable"
    assert stream.on_delta(SampleDelta("r", 0, [6])) == ([], None)


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_in_pieces_join_and_leave_in_events_that_fit(tokenizer, stream):
    """Deltas carry a long prompt's logprobs in slices; the events carry them in order, each
    event within its byte budget, and only the last event is final."""
    k, num = 5, 400
    prompt = [(7 * i) % 300 + 3 for i in range(num)]
    params = SamplingParams(prompt_logprobs=k)
    prepared = Prepared("r", prompt, params, stream, None)
    stream_ = Stream(prepared, tokenizer, "inbox", msgpack=False, max_event_bytes=8192)
    whole = PromptLogprobs(
        1,
        [-1.0 - i for i in range(num - 1)],
        [1] * (num - 1),
        [[3] * k] * (num - 1),
        [[-0.5] * k] * (num - 1),
    )
    slices = split_rows(whole, 2048)
    assert len(slices) > 3
    events = []
    for piece in slices[:-1]:
        events += stream_.on_delta(SampleDelta("r", 0, prompt_logprobs=piece))[0]
    last = SampleDelta("r", 0, [9], finish_reason="length", prompt_logprobs=slices[-1])
    events += stream_.on_delta(last)[0]
    assert [e.seq for e in events] == list(range(len(events))) and len(events) > 3
    assert all(len(msgspec.json.encode(e)) <= 8192 for e in events)
    assert [e.is_final for e in events] == [False] * (len(events) - 1) + [True]
    rows = [row for e in events for row in (e.prompt_logprobs or [])]
    assert rows[0] is None and len(rows) == num
    assert [row.token_id for row in rows[1:]] == prompt[1:]
    assert [row.logprob for row in rows[1:]] == whole.logprobs
    assert events[-1].token_ids == [9] and events[0].num_prompt_tokens == num
