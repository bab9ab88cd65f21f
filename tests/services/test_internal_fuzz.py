"""Every internal message type fuzzed against the real services (#23): random bytes, truncated
and mistyped msgpack, out-of-range ids, unknown requests, duplicates and floods on each
internal subject, while greedy streams run beside them. The services answer what has an
answer with a typed error, drop the rest, keep serving, the streams equal an undisturbed run,
and block accounting holds (every block free at the end).

Well-formed messages that impersonate a peer at the right moment (a fake answer to the step in
flight) are what authentication keeps out (tests/services/test_isolation.py), not this test.
"""

import asyncio
import random

import msgspec
import nats
import pytest
from kvpager.schemas.executor import CachedRequest, NewRequest, RunStep, ScheduledStep, StepPiece
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import (
    AddRequest,
    ExecutorReady,
    FinishRequest,
    PromptPiece,
    StepDone,
    StepFailed,
    StepOutput,
)
from kvpager.schemas.tokenizer import AddResult, SampleDelta, TokenBatch
from kvpager.services.client import Client
from kvpager.services.connection import flush_sent
from kvpager.services.subjects import Subjects
from kvpager.services.wire import pack

from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free

PREFIX = "ifuzz"
PROMPTS = ["Once upon a time", "The quick brown fox", "Paged attention", "A scheduler"]
NUM_RANDOM = 200  # random byte strings per subject
FAR = 10**9  # step ids no scheduler has in flight


@pytest.fixture(scope="module")
def fuzzed(nats_server, tiny_llama, tmp_path_factory):
    services = start_services(
        nats_server.url, tiny_llama, tmp_path_factory.mktemp("ifuzz"), prefix=PREFIX
    )
    yield services
    stop_and_check(services)


async def _greedy(client: Client) -> list[list[int]]:
    async def one(prompt: str) -> list[int]:
        events = [e async for e in client.generate(prompt=prompt, max_tokens=24, temperature=0.0)]
        assert events[-1].finish_reason in ("length", "stop"), events[-1]
        return [t for e in events for t in e.token_ids]

    return list(await asyncio.gather(*map(one, PROMPTS)))


async def _tokens_subject(nc, subjects: Subjects, client: Client) -> str:
    """The tokenizer replica's token subject, seen once on the wire."""
    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    async def note(msg) -> None:
        if not seen.done():
            seen.set_result(msg.subject)

    sub = await nc.subscribe(f"{subjects.prefix}.internal.*.tokens.*", cb=note)
    await flush_sent(nc)
    [e async for e in client.generate(prompt="hello", max_tokens=2)]
    subject = await asyncio.wait_for(seen, 10.0)
    await sub.unsubscribe()
    return subject


def _random_bytes(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 64))
    if kind == 1:  # a msgpack array of the right length, wrong field types
        return msgspec.msgpack.encode(["step", [rng.random(), "x", None]])
    if kind == 2:  # truncated real message
        full = pack(RunStep(ScheduledStep(FAR, num_scheduled_tokens={"a": 1})))
        return full[: rng.randrange(1, len(full))]
    return msgspec.msgpack.encode({"tag": rng.random(), "step": -1})


def _typed_messages(subjects: Subjects) -> list[tuple[str, bytes]]:
    """Well-formed messages with out-of-range ids, unknown requests, floods and duplicates."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    huge = 2**31 - 1
    to_executor = [
        RunStep(ScheduledStep(FAR + i, new_requests=[NewRequest("x", [5], 1, greedy, [huge], 0)]))
        for i in range(3)
    ]
    to_executor += [
        RunStep(ScheduledStep(FAR, cached_requests=[CachedRequest("nobody", 3)])),
        RunStep(ScheduledStep(FAR, blocks_to_copy=[(huge, -5)], blocks_to_swap_in=[(-1, 0)])),
        StepPiece("flood", [7] * 60),
    ]
    to_scheduler = [
        PromptPiece("orphan", [5] * 60),  # no AddRequest follows: dropped after its TTL
        FinishRequest("nobody", "abort"),
        FinishRequest("nobody", "stop", index=3, stop_reason="x"),
    ]
    outputs = [
        StepDone(StepOutput(FAR, ["nobody"], [5]), 0.0, 0.0),
        StepFailed(FAR + 1, "not a step of yours"),
    ]
    return (
        [(subjects.executor_steps, pack(m)) for m in to_executor]
        + [(subjects.scheduler_requests, pack(m)) for m in to_scheduler]
        + [(subjects.scheduler_outputs, pack(m)) for m in outputs]
    )


async def _bad_adds(nc, subjects: Subjects, reply_to: str) -> list[AddResult]:
    """AddRequests the scheduler must refuse with a typed error, one answer each."""
    bad = [
        AddRequest("oov", [5, 10**7], SamplingParams(max_tokens=2), reply_to),
        AddRequest("empty", [], SamplingParams(max_tokens=2), reply_to),
        AddRequest("long", [5] * 5000, SamplingParams(max_tokens=2), reply_to),
        AddRequest("wide", [5], SamplingParams(max_tokens=2, n=10**4), reply_to),
    ]
    answers = []
    for add in bad:
        reply = await nc.request(subjects.scheduler_requests, pack(add), timeout=10.0)
        answers.append(msgspec.msgpack.decode(reply.data, type=AddResult))
    return answers


async def test_fuzzed_internal_messages_leave_the_services_serving(fuzzed):
    subjects = Subjects(PREFIX, "default")
    client = await Client.connect(fuzzed.url, PREFIX)
    nc = await nats.connect(fuzzed.url)
    rng = random.Random(23)
    try:
        undisturbed = await _greedy(client)
        tokens_subject = await _tokens_subject(nc, subjects, client)
        running = asyncio.ensure_future(_greedy(client))
        internal = [
            subjects.executor_steps,
            subjects.scheduler_requests,
            subjects.scheduler_outputs,
            subjects.kv_events,
            tokens_subject,
        ]
        for subject in internal:
            for _ in range(NUM_RANDOM):
                await nc.publish(subject, _random_bytes(rng))
        for subject, data in _typed_messages(subjects) * 3:  # duplicates too
            await nc.publish(subject, data)
        stray = SampleDelta("nobody", 0, [5], finish_reason="length")
        await nc.publish(tokens_subject, pack(TokenBatch(FAR, [stray])))
        for data in (b"", b"\x00", pack(ExecutorReady("fake", 10**12, 0, 16, 8, 64, [], 9, "m"))):
            with pytest.raises(nats.errors.TimeoutError):  # refused: no answer, no attach
                await nc.request(subjects.scheduler_attach, data, timeout=1.0)
        answers = await _bad_adds(nc, subjects, tokens_subject)
        assert all(a.error is not None for a in answers), answers
        assert {a.error.type for a in answers} <= {"invalid_request", "request_too_long"}
        assert await asyncio.wait_for(running, 120) == undisturbed
        assert await _greedy(client) == undisturbed  # and still serving after it all
        stats = await wait_all_blocks_free(client)
        assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks, stats
        for name, process in fuzzed.processes.items():
            assert process.poll() is None, f"{name} exited"
    finally:
        await nc.close()
        await client.close()
