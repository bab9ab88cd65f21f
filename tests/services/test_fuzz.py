"""Bad input, fuzzed against the real services: every `llm.generate` gets exactly one typed error
or a valid stream, `llm.abort` never breaks anything, the services stay up and every KV block is
free at the end. Also the tokenizer's per-request caps."""

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvpager.schemas.public import GenerateEvent
from kvpager.services.client import KEEPALIVE_HEADER, Client, ends_stream, requested_samples
from kvpager.services.wire import MSGPACK_HEADERS

from tests.models import VOCAB_SIZE
from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free

NUM_BATCHES = 28
BATCH_SIZE = 40  # cases sent at once; NUM_BATCHES x BATCH_SIZE >= 1,000 per run
MAX_REQUEST_BYTES = 16384
LIMITS_ENV = {
    "KVPAGER_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
    "KVPAGER_MAX_PROMPT_TOKENS": "200",
    "KVPAGER_MAX_OUTPUT_TOKENS": "64",
    "KVPAGER_MAX_N": "4",
    "KVPAGER_MAX_BEAM_WIDTH": "4",
    "KVPAGER_MAX_STOP_STRINGS": "4",
    "KVPAGER_MAX_STOP_STRING_CHARS": "32",
}
REFUSED = frozenset({"error:invalid_request", "error:request_too_long"})
ANY = frozenset({"ok", "abort"} | REFUSED | {"error:deadline_exceeded"})


@pytest.fixture(scope="module")
def fuzz_services(nats_server, tiny_llama, tmp_path_factory):
    services = start_services(
        nats_server.url, tiny_llama, tmp_path_factory.mktemp("fuzz"), prefix="fuzz", **LIMITS_ENV
    )
    yield services
    stop_and_check(services)


# --- cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One message: a generate request (with the outcomes it may have) or an abort."""

    body: bytes
    msgpack: bool = False
    allowed: frozenset[str] = ANY  # "ok", "abort" or "error:<type>"
    abort: bool = False  # published on llm.abort, nothing comes back
    reply: bool = True

    def __repr__(self) -> str:
        body = self.body if len(self.body) < 300 else self.body[:300] + b"..."
        kind = "abort" if self.abort else "msgpack" if self.msgpack else "json"
        return f"Case({kind}, {body!r}, allowed={sorted(self.allowed)}, reply={self.reply})"


def _encode(obj, msgpack: bool) -> bytes:
    try:
        return msgspec.msgpack.encode(obj) if msgpack else msgspec.json.encode(obj)
    except OverflowError:  # ints beyond 64 bits only travel as JSON
        return msgspec.json.encode(obj)


request_ids = st.text(st.characters(codec="utf-8", exclude_characters="#"), min_size=1, max_size=12)
prompts = st.one_of(
    st.text(min_size=1, max_size=40).map(lambda text: {"prompt": text}),
    st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=30).map(
        lambda ids: {"prompt_token_ids": ids}
    ),
    st.text(max_size=30).map(lambda text: {"messages": [{"role": "user", "content": text}]}),
)
knobs = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 4)},
    optional={
        "temperature": st.sampled_from([0.0, 1e-9, 0.5, 1.0, 2.0, 1e6]),
        "top_p": st.floats(0.001, 1.0),
        "top_k": st.sampled_from([-1, 0, 1, 7, VOCAB_SIZE + 1, 2**31 - 1]),
        "min_p": st.floats(0.0, 1.0),
        "seed": st.integers(0, 2**63 - 1),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "repetition_penalty": st.sampled_from([1e-3, 0.5, 1.0, 2.0, 1e3]),
        "min_tokens": st.integers(0, 1),
        "stop": st.one_of(
            st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)
        ),
        "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=4),
        "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(),
        "logprobs": st.none() | st.integers(0, 20),
        "skip_special_tokens": st.booleans(),
        "n": st.integers(1, 3),
        "stream": st.booleans(),
        "timeout": st.floats(30.0, 1e9),
        "deadline": st.sampled_from([time.time() + 3600, 1e12]),
        "length_penalty": st.floats(-5.0, 5.0),
    },
)
valid_requests = st.builds(lambda p, k: {**p, **k}, prompts, knobs)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
field_names = st.sampled_from(
    ["prompt", "messages", "prompt_token_ids", "max_tokens", "n", "temperature", "top_p", "top_k"]
    + ["stop", "timeout", "deadline", "seed", "logprobs", "beam_width", "request_id", "stream"]
    + ["min_tokens", "stop_token_ids", "colour", ""]
)
bad_limits = st.sampled_from(
    [("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 10**30), ("n", 0), ("n", 5)]
    + [("timeout", 0), ("timeout", -1.0), ("logprobs", -1), ("logprobs", 21), ("top_k", -2)]
    + [("top_p", 0.0), ("temperature", -0.5), ("temperature", 1e400), ("deadline", -5.0)]
    + [("seed", 2**64), ("max_tokens", 65), ("beam_width", 0), ("min_tokens", 99)]
)


@st.composite
def valid_cases(draw) -> Case:
    msgpack = draw(st.booleans())
    return Case(_encode(draw(valid_requests), msgpack), msgpack, frozenset({"ok"}))


@st.composite
def wrong_fields(draw) -> Case:
    """A valid request with one field replaced by anything at all: any typed outcome."""
    request = draw(valid_requests)
    request[draw(field_names)] = draw(anything)
    return Case(_encode(request, msgpack := draw(st.booleans())), msgpack)


@st.composite
def bad_values(draw) -> Case:
    request = draw(valid_requests)
    name, value = draw(bad_limits)
    request[name] = value
    msgpack = draw(st.booleans())
    return Case(_encode(request, msgpack), msgpack, REFUSED)


@st.composite
def broken_bodies(draw) -> Case:
    """Truncated, non-UTF-8, NaN, empty, oversized or plain random bodies."""
    msgpack = draw(st.booleans())
    body = _encode(draw(valid_requests), msgpack)
    kind = draw(st.sampled_from(["truncated", "utf8", "nan", "empty", "big", "random", "mixed"]))
    if kind == "truncated":
        body = body[: draw(st.integers(0, len(body) - 1))]
    elif kind == "utf8":
        body, msgpack = b'{"prompt": "ok \xff\xfe \xc3\x28"}', draw(st.booleans())
    elif kind == "nan":
        value = draw(st.sampled_from(["temperature", "top_p", "deadline", "length_penalty"]))
        if msgpack:
            body = _encode({"prompt": "x", value: math.nan}, True)
        else:
            body = b'{"prompt": "x", "%s": NaN}' % value.encode()
    elif kind == "empty":
        body = draw(st.sampled_from([b"", b" ", b"\n\t", b"null", b"{}", b"[]", b'""']))
    elif kind == "big":
        body = b'{"prompt": "' + b"a" * draw(st.integers(MAX_REQUEST_BYTES, 4 * MAX_REQUEST_BYTES))
        body += b'"}'
    elif kind == "random":
        body = draw(st.binary(max_size=64))
    else:  # the other encoding's bytes under this encoding's header
        body = _encode(draw(valid_requests), not msgpack)
    return Case(body, msgpack, REFUSED)


@st.composite
def aborts(draw) -> Case:
    body = draw(
        st.one_of(
            request_ids.map(lambda rid: msgspec.json.encode({"request_id": rid})),
            st.binary(max_size=32),
            st.just(b"x" * (MAX_REQUEST_BYTES + 1)),
            anything.map(lambda value: _encode({"request_id": value}, False)),
        )
    )
    return Case(body, abort=True)


@st.composite
def targeted(draw) -> list[Case]:
    """Same-id pairs: duplicates in flight, and aborts before, during or after the request."""
    request_id = draw(request_ids)
    request = {**draw(valid_requests), "request_id": request_id}
    msgpack = draw(st.booleans())
    body = _encode(request, msgpack)
    abort = Case(msgspec.json.encode({"request_id": request_id}), abort=True)
    cases = [Case(body, msgpack, frozenset({"ok", "abort", "error:invalid_request"}))]
    extra = draw(st.sampled_from(["abort", "duplicate", "both"]))
    if extra in ("duplicate", "both"):
        cases.append(cases[0])
    if extra in ("abort", "both"):
        cases.insert(draw(st.integers(0, len(cases))), abort)
    return cases


cases = st.one_of(
    valid_cases().map(lambda case: [case]),
    wrong_fields().map(lambda case: [case]),
    bad_values().map(lambda case: [case]),
    broken_bodies().map(lambda case: [case]),
    aborts().map(lambda case: [case]),
    targeted(),
    valid_cases().map(lambda case: [Case(case.body, case.msgpack, ANY, reply=False)]),
)
batches = st.lists(cases, min_size=BATCH_SIZE, max_size=BATCH_SIZE).map(
    lambda groups: [case for group in groups for case in group]
)


# --- sending and checking -----------------------------------------------------------------------


def outcome(case: Case, events: list[GenerateEvent]) -> str:
    """What a stream came to; asserts it is well formed (seq, one final, finishes per sample)."""
    assert [event.seq for event in events] == list(range(len(events))), "seq gap"
    finished = [event.index for event in events if event.finish_reason is not None]
    assert sorted(finished) == list(range(len(finished))), "one finish per sample"
    assert [event.index for event in events if event.is_final] == finished, "usage per sample"
    final = events[-1]
    assert final.is_final
    if final.error is not None:
        return f"error:{final.error.type}"
    num_tokens = sum(len(event.token_ids) for event in events)
    assert final.usage.num_completion_tokens == num_tokens
    reasons = {event.finish_reason for event in events if event.finish_reason is not None}
    return "abort" if "abort" in reasons else "ok"


async def _send_batch(url: str, batch: list[Case], seen: Counter) -> None:
    nc = (await Client.connect(url, "fuzz")).nc
    try:
        subs = {}
        for index, case in enumerate(batch):
            if case.abort:
                await nc.publish("fuzz.abort", case.body)
                seen["aborts sent"] += 1
                continue
            headers = MSGPACK_HEADERS if case.msgpack else None
            inbox = nc.new_inbox() if case.reply else ""
            if case.reply:
                subs[index] = await nc.subscribe(inbox)
            await nc.publish("fuzz.generate", case.body, reply=inbox, headers=headers)
            seen["requests sent"] += 1
        results = await asyncio.wait_for(
            asyncio.gather(*(_stream(sub, batch[i]) for i, sub in subs.items())), 60
        )
        await asyncio.sleep(0.3)  # nothing may follow a final event
        for (index, sub), events in zip(subs.items(), results):
            case = batch[index]
            assert sub.pending_msgs == 0, (case, "messages after the final event")
            assert outcome(case, events) in case.allowed, (case, events)
            seen[outcome(case, events)] += 1
    finally:
        await nc.close()


async def _stream(sub, case: Case) -> list[GenerateEvent]:
    msgpack, events, num_finals = case.msgpack, [], 0
    num_samples = requested_samples(case.body, MSGPACK_HEADERS if msgpack else None)
    while not events or not ends_stream(events[-1], num_finals, num_samples):
        msg = await sub.next_msg(timeout=60)
        headers = msg.headers or {}
        if KEEPALIVE_HEADER in headers:
            continue
        assert (headers.get("Content-Type") == "application/msgpack") == msgpack, headers
        decoder = msgspec.msgpack if msgpack else msgspec.json
        events.append(decoder.decode(msg.data, type=GenerateEvent))
        num_finals += events[-1].is_final
    return events


def test_fuzzed_requests_and_aborts(fuzz_services):
    seen: Counter = Counter()

    @settings(
        max_examples=NUM_BATCHES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # a failing batch is reported as it is
        suppress_health_check=list(HealthCheck),
    )
    @given(batches)
    def check(batch: list[Case]) -> None:
        asyncio.run(_send_batch(fuzz_services.url, batch, seen))

    check()
    assert seen["requests sent"] + seen["aborts sent"] >= 1000, seen
    assert seen["ok"] > 50 and seen["error:invalid_request"] > 200, seen
    assert all(process.poll() is None for process in fuzz_services.processes.values())
    stats = asyncio.run(_final_stats(fuzz_services.url))
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks, stats
    assert stats.num_running == stats.num_waiting == 0, stats
    print(f"fuzz: {dict(seen)}")


async def _final_stats(url: str):
    client = await Client.connect(url, "fuzz")
    try:
        assert (await client.health()).status == "ok"
        return await wait_all_blocks_free(client, timeout_s=30.0)
    finally:
        await client.close()


# --- caps -------------------------------------------------------------------------------------

CAPPED = [  # (fields, error type, param)
    ({"prompt_token_ids": [5] * 201}, "request_too_long", "prompt_token_ids"),
    ({"prompt": "x", "max_tokens": 65}, "invalid_request", "max_tokens"),
    ({"prompt": "x", "n": 5}, "invalid_request", "n"),
    ({"prompt": "x", "beam_width": 5, "temperature": 0.0}, "invalid_request", "beam_width"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
    ({"prompt": "x", "stop": "s" * 33}, "invalid_request", "stop"),
    ({"prompt": "x" * MAX_REQUEST_BYTES}, "invalid_request", None),
    (
        {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}},
        "invalid_request",
        "logit_bias",
    ),
    ({"prompt": "x", "logit_bias": {str(VOCAB_SIZE): 1}}, "invalid_request", "logit_bias"),
]


@pytest.mark.parametrize("fields, error_type, param", CAPPED)
async def test_request_caps(fuzz_services, fields, error_type, param):
    client = await Client.connect(fuzz_services.url, "fuzz")
    try:
        events = [e async for e in client.generate_raw(msgspec.json.encode(fields))]
        assert len(events) == 1 and events[0].error is not None, events
        assert (events[0].error.type, events[0].error.param) == (error_type, param), events
        at_limits = dict(prompt_token_ids=[5] * 200, max_tokens=2, n=4, stop=["a"] * 4)
        events = [e async for e in client.generate(**at_limits)]
        assert events[-1].error is None and events[-1].usage.num_prompt_tokens == 200
    finally:
        await client.close()


async def test_parallel_samples_with_the_largest_seed(fuzz_services):
    """Found by the fuzz test: sample seeds past 2**63 once crashed the scheduler's loop."""
    client = await Client.connect(fuzz_services.url, "fuzz")
    try:
        fields = dict(prompt="x", n=3, seed=2**63 - 1, max_tokens=2, ignore_eos=True)
        events = [e async for e in client.generate(**fields)]
        assert events[-1].error is None and events[-1].usage.num_completion_tokens == 6
    finally:
        await client.close()
