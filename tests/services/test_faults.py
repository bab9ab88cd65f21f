"""Faults: a killed or hung executor, a killed scheduler or tokenizer replica, a restarted
nats-server, a passed deadline. Every stream still ends with one final event, typed errors come
fast, the services recover, and no KV block is leaked.

The tests run in order on one set of services (two tokenizer replicas) and one nats-server of
their own, each leaving everything healthy for the next.
"""

import asyncio
import signal
import time

import pytest
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.worker.executor import Executor
from kvpager.schemas.executor import NewRequest, ScheduledStep
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.client import Client

from tests.nats_server import NatsServer
from tests.services.conftest import Services, start_services, wait_all_blocks_free

PREFIX = "faults"
FAULT_ENV = {
    "KVPAGER_HEARTBEAT_INTERVAL": "0.25",
    "KVPAGER_LIVENESS_TIMEOUT": "3",
    "KVPAGER_NUM_BLOCKS": "160",
    "KVPAGER_DRAIN_TIMEOUT": "2",
}
IDLE_TIMEOUT_S = 3.0  # a stream silent this long (no keepalive) has lost its tokenizer
PROMPTS = ["Once upon a time", "The quick brown fox", "Paged attention", "A scheduler"]


@pytest.fixture(scope="module")
def nats(tmp_path_factory):
    server = NatsServer()  # its own: the test restarts it
    yield server
    server.stop()


@pytest.fixture(scope="module")
def faulty(nats, tiny_llama, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("faults")
    names = ("executor", "scheduler", "tokenizer")
    services = start_services(nats.url, tiny_llama, log_dir, PREFIX, names[:2], **FAULT_ENV)
    try:
        for name in ("tokenizer", "tokenizer2"):  # all four start together
            services.launch(name, "tokenizer")
        services.wait_healthy()
        _until_logged(services, "tokenizer2", "tokenizer ready")
    except BaseException:  # leave no process behind
        services.stop()
        raise
    yield services
    codes = services.stop()  # the killed tokenizer replica is no longer among them
    assert set(codes.values()) == {0}, codes


@pytest.fixture
async def client(faulty):
    connected = await Client.connect(
        faulty.url, PREFIX, idle_timeout=IDLE_TIMEOUT_S, reconnect_time_wait=0.2
    )
    yield connected
    stats = await wait_all_blocks_free(connected, timeout_s=10.0)
    await connected.close()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks, stats
    assert stats.num_running == stats.num_waiting == 0, stats


class Streams:
    """Requests in flight, each event stamped with its arrival time."""

    def __init__(self, client: Client, num: int, max_tokens: int, tag: str) -> None:
        self.records: list[list] = [[] for _ in range(num)]
        self.tasks = [
            asyncio.create_task(
                self._consume(client.generate(**self._fields(tag, i, max_tokens)), record)
            )
            for i, record in enumerate(self.records)
        ]

    @staticmethod
    def _fields(tag: str, i: int, max_tokens: int) -> dict:
        prompt = PROMPTS[i % len(PROMPTS)]
        return dict(request_id=f"{tag}-{i}", prompt=prompt, max_tokens=max_tokens, ignore_eos=True)

    @staticmethod
    async def _consume(stream, record: list) -> None:
        async for event in stream:  # StreamGapError would fail the test
            record.append((time.monotonic(), event))

    async def until_streaming(self, num: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(bool(record) for record in self.records) < num:
            assert time.monotonic() < deadline, "streams did not start"
            await asyncio.sleep(0.02)

    async def finals(self, timeout_s: float) -> list[tuple[float, object]]:
        """Each stream's final event and when it came; all must come within `timeout_s`."""
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s)
        for record in self.records:
            assert [event.is_final for _, event in record][-1], record
        return [record[-1] for record in self.records]


async def _generate(client: Client, **fields) -> list:
    fields = {"temperature": 0.0, "max_tokens": 8, **fields}
    return [e async for e in client.generate(**fields)]


async def _healthy(services: Services) -> None:
    await asyncio.to_thread(services.wait_healthy)


async def test_deadline_passing_mid_stream_aborts(client: Client):
    started = time.time()
    events = await _generate(
        client, prompt="late", max_tokens=900, ignore_eos=True, deadline=started + 0.5
    )
    final = events[-1]
    assert final.finish_reason == "abort" and final.error.type == "deadline_exceeded"
    assert time.time() - started < 3.0 and 0 < final.usage.num_completion_tokens < 900


async def test_executor_killed_mid_stream(client: Client, faulty: Services):
    reference = await _generate(client, prompt=PROMPTS[0])
    streams = Streams(client, 32, max_tokens=400, tag="exec")
    await streams.until_streaming(8)
    killed_at = time.monotonic()
    _kill(faulty.processes["executor"])
    finals = await streams.finals(timeout_s=10.0)
    latencies = [at - killed_at for at, _ in finals]
    assert {event.error.type for _, event in finals} == {"executor_unavailable"}, finals
    assert max(latencies) < 5.0, latencies
    print(f"executor killed: final events after {min(latencies):.3f}-{max(latencies):.3f} s")
    stats = await wait_all_blocks_free(client)
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0, stats
    sent = time.monotonic()
    events = await _generate(client, prompt="while it is down")
    assert events[-1].error.type == "executor_unavailable" and time.monotonic() - sent < 1.0
    faulty.launch("executor")
    await _healthy(faulty)
    events = await _generate(client, prompt=PROMPTS[0])
    assert [e.token_ids for e in events] == [e.token_ids for e in reference]
    assert events[-1].finish_reason == "length"


async def test_executor_hung_mid_stream(client: Client, faulty: Services):
    """SIGSTOP: the process lives but answers nothing. Liveness pings catch it; after SIGCONT it
    finds itself dropped, forgets every request and attaches afresh."""
    reference = await _generate(client, prompt=PROMPTS[1])
    streams = Streams(client, 16, max_tokens=400, tag="hung")
    await streams.until_streaming(8)
    executor = faulty.processes["executor"]
    hung_at = time.monotonic()
    executor.send_signal(signal.SIGSTOP)
    try:
        finals = await streams.finals(timeout_s=15.0)
    finally:
        executor.send_signal(signal.SIGCONT)
    latencies = [at - hung_at for at, _ in finals]
    assert {event.error.type for _, event in finals} == {"executor_unavailable"}, finals
    liveness_timeout = float(FAULT_ENV["KVPAGER_LIVENESS_TIMEOUT"])
    assert max(latencies) < liveness_timeout + 3.0, latencies
    print(f"executor hung: final events after {min(latencies):.3f}-{max(latencies):.3f} s")
    stats = await wait_all_blocks_free(client)
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0, stats
    await _healthy(faulty)  # the woken executor attached again
    events = await _generate(client, prompt=PROMPTS[1])
    assert [e.token_ids for e in events] == [e.token_ids for e in reference]
    assert events[-1].finish_reason == "length"


async def test_scheduler_killed_and_restarted(client: Client, faulty: Services):
    streams = Streams(client, 8, max_tokens=400, tag="sched")
    await streams.until_streaming(8)
    killed_at = time.monotonic()
    _kill(faulty.processes["scheduler"])
    finals = await streams.finals(timeout_s=10.0)
    assert {event.error.type for _, event in finals} == {"unavailable"}, finals
    print(f"scheduler killed: final events after {max(at for at, _ in finals) - killed_at:.3f} s")
    events = await _generate(client, prompt="while it is down")
    assert events[-1].error.type == "unavailable"
    faulty.launch("scheduler")
    await _healthy(faulty)  # the executor attached to the new scheduler
    events = await _generate(client, prompt="after the restart")
    assert events[-1].finish_reason == "length"


async def test_tokenizer_replica_killed(client: Client, faulty: Services):
    streams = Streams(client, 16, max_tokens=150, tag="tok")
    await streams.until_streaming(16)  # accepted by one replica or the other
    killed_at = time.monotonic()
    _kill(faulty.processes.pop("tokenizer"))  # stays dead: the other replica serves
    finals = await streams.finals(timeout_s=60.0)
    lost = [at - killed_at for at, event in finals if event.error is not None]
    kept = [event for _, event in finals if event.error is None]
    assert lost and kept, "both replicas served some of the streams"
    assert {event.error.type for _, event in finals if event.error} == {"connection_lost"}
    assert max(lost) < IDLE_TIMEOUT_S + 2.0, lost
    assert all(e.usage.num_completion_tokens == 150 for e in kept)
    print(f"tokenizer killed: {len(lost)} streams lost after <= {max(lost):.3f} s")
    for i in range(4):  # the other replica takes every new request
        events = await _generate(client, prompt=f"survivor {i}")
        assert events[-1].finish_reason == "length"


async def test_nats_server_restarted(client: Client, faulty: Services, nats: NatsServer):
    streams = Streams(client, 8, max_tokens=400, tag="nats")
    await streams.until_streaming(8)
    nats.stop()
    await asyncio.sleep(0.5)
    restarted = NatsServer(port=nats.port)
    nats.process = restarted.process  # the fixture stops this one
    finals = await streams.finals(timeout_s=20.0)
    assert all(event.error is None or event.error.type in ERROR_TYPES for _, event in finals)
    await _healthy(faulty)  # every service reconnected; the executor attached again
    events = await _generate(client, prompt="after the restart")
    assert events[-1].finish_reason == "length"
    assert all(process.poll() is None for process in faulty.processes.values())


ERROR_TYPES = {"connection_lost", "unavailable", "executor_unavailable"}


def test_executor_reset_forgets_every_request(tiny_llama):
    """What an executor does when a new scheduler takes over: no row stays taken."""
    config = ExecutorConfig(model_path=tiny_llama, num_blocks=8, max_num_seqs=2, max_model_len=64)
    executor = Executor(config, ModelConfig.from_path(tiny_llama))
    new = NewRequest("r", [5, 6, 7], 3, SamplingParams(temperature=0.0), [0], 0)
    executor.execute(ScheduledStep(1, new_requests=[new], num_scheduled_tokens={"r": 3}))
    assert list(executor.batch.states) == ["r"]
    executor.reset()
    assert executor.batch.states == {} and len(executor.batch.free_rows) == 2
    output = executor.execute(ScheduledStep(1, new_requests=[new], num_scheduled_tokens={"r": 3}))
    assert output.seq_ids == ["r"]  # the same id is new again


def _kill(process) -> None:
    process.kill()  # SIGKILL: no goodbye to anyone
    process.wait()


def _until_logged(services: Services, name: str, text: str) -> None:
    for _ in range(1200):
        if any(text in line for line in services.log_lines(name)):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{name} did not log {text!r}")
