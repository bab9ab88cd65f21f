"""Stream: SampleDeltas to numbered events, stop strings, one final event (no NATS)."""

import pytest
from transformers import AutoTokenizer

from schemas.public import ErrorInfo
from schemas.sampling import SamplingParams
from schemas.tokenizer import SampleDelta
from services.tokenizer.requests import Prepared
from services.tokenizer.streams import Stream


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
