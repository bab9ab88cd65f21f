"""Two instances (scheduler + executor pairs) behind one tokenizer: discovery, KV-aware
routing, streams that survive a dead instance (migration), and a second tokenizer replica
killed mid-stream (its streams lost to the client, then sent again).

The tests run in order on one set of services and a nats-server of their own; every test
ends with every block free on both instances.
"""

import asyncio
import json
import random
import time

import pytest
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats

from tests.nats_server import NatsServer
from tests.services.conftest import Services, start_services

PREFIX = "replicas"
INSTANCES = ("a", "b")
REPLICA_ENV = {
    "KVPAGER_HEARTBEAT_INTERVAL": "0.25",
    "KVPAGER_LIVENESS_TIMEOUT": "3",
    "KVPAGER_NUM_BLOCKS": "160",
    "KVPAGER_DRAIN_TIMEOUT": "2",
    # 8 running an instance: 64 streams there run in waves, so a kill that lands late (the
    # client's view lags the engines' on busy cores) still finds most of them unfinished
    "KVPAGER_MAX_NUM_SEQS": "8",
}
BLOCK = 16  # conftest's KVPAGER_BLOCK_SIZE
NUM_SYSTEMS, NUM_USERS, SYSTEM_LEN = 8, 16, 2 * BLOCK


@pytest.fixture(scope="module")
def nats():
    server = NatsServer()
    yield server
    server.stop()


def launch_instance(services: Services, instance: str) -> None:
    for kind in ("executor", "scheduler"):
        services.launch(f"{kind}-{instance}", kind, KVPAGER_INSTANCE=instance)


def launch_tokenizer(services: Services, router: str = "kv", name: str = "tokenizer") -> None:
    services.launch(name, "tokenizer", KVPAGER_ROUTER=router)


@pytest.fixture(scope="module")
def replicas(nats, tiny_llama, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("replicas")
    services = start_services(nats.url, tiny_llama, log_dir, PREFIX, (), **REPLICA_ENV)
    try:
        for instance in INSTANCES:
            launch_instance(services, instance)
        launch_tokenizer(services)
        services.wait_healthy()
        asyncio.run(until_instances(services))
    except BaseException:
        services.stop()
        raise
    yield services
    codes = services.stop()
    assert set(codes.values()) == {0}, codes


async def until_instances(
    services: Services, tokenizer: str = "tokenizer", timeout_s: float = 60.0
) -> None:
    """Both instances answer with an executor attached, and the tokenizer found both."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in services.log_lines(tokenizer) if "instance found" in line]
        if all(any(f'"{name}"' in line for line in found) for name in INSTANCES):
            client = await Client.connect(services.url, PREFIX)
            try:
                stats = await gather_stats(client.nc, f"{PREFIX}.stats", 1.0)
            finally:
                await client.close()
            if sorted(s.instance for s in stats) == list(INSTANCES):
                return
        await asyncio.sleep(0.1)
    raise TimeoutError("the instances did not come up")


async def all_blocks_free(client: Client, timeout_s: float = 10.0) -> list:
    """Every instance's stats once nothing runs or waits there and every block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await gather_stats(client.nc, f"{PREFIX}.stats", 1.0)
        free = all(
            s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_blocks for s in stats
        )
        if (free and len(stats) == len(INSTANCES)) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


@pytest.fixture
async def client(replicas):
    connected = await Client.connect(replicas.url, PREFIX, reconnect_time_wait=0.2)
    yield connected
    stats = await all_blocks_free(connected)
    await connected.close()
    assert sorted(s.instance for s in stats) == list(INSTANCES), stats
    for s in stats:
        assert s.num_used_blocks == 0 and s.num_free_blocks == s.num_blocks, s
        assert s.num_running == s.num_waiting == 0, s


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """NUM_USERS rounds of NUM_SYSTEMS prompts: a system prompt of 2 full blocks + a user's.
    Each round starts one system later, so round-robin sends a system's users to both."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 300) for _ in range(SYSTEM_LEN)] for _ in range(NUM_SYSTEMS)]
    users = [[rng.randrange(3, 300) for _ in range(7)] for _ in range(NUM_USERS)]
    return [
        systems[(u + k) % NUM_SYSTEMS] + user
        for u, user in enumerate(users)
        for k in range(NUM_SYSTEMS)
    ]


async def run_all(client: Client, prompts: list[list[int]], **fields) -> list[list]:
    """Every prompt at once (in order); each stream's events."""

    async def one(i: int, prompt: list[int]) -> list:
        params = dict(temperature=0.0, max_tokens=4, ignore_eos=True, **fields)
        return [e async for e in client.generate(prompt_token_ids=prompt, **params)]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def hits_and_outputs(streams: list[list]) -> tuple[int, list[list[int]]]:
    for events in streams:
        assert events[-1].is_final and events[-1].error is None, events[-1]
        assert [e.seq for e in events] == list(range(len(events)))
    hits = sum(events[-1].usage.num_cached_prompt_tokens for events in streams)
    return hits, [[t for e in events for t in e.token_ids] for events in streams]


async def test_kv_routing_prefills_each_prefix_once(client: Client, replicas: Services):
    ideal = NUM_SYSTEMS * (NUM_USERS - 1) * SYSTEM_LEN
    kv_hits, kv_outputs = hits_and_outputs(await run_all(client, shared_prefix_prompts(1)))
    assert ideal - BLOCK <= kv_hits <= ideal, (kv_hits, ideal)
    per_instance = await all_blocks_free(client)
    assert all(sum(s.num_finished.values()) > 0 for s in per_instance), per_instance

    # the same again through a round-robin tokenizer, on fresh prefixes
    replicas.processes["tokenizer"].terminate()
    assert replicas.processes["tokenizer"].wait(timeout=30) == 0
    launch_tokenizer(replicas, "round-robin")
    await asyncio.to_thread(replicas.wait_healthy)
    await until_instances(replicas)
    rr_hits, _ = hits_and_outputs(await run_all(client, shared_prefix_prompts(2)))
    twice = NUM_SYSTEMS * (NUM_USERS - 2) * SYSTEM_LEN  # each prefix prefilled on both
    assert rr_hits <= twice + BLOCK, (rr_hits, twice)
    # routing never changes outputs: the first prompts again, round-robin, warm caches
    _, rr_outputs = hits_and_outputs(await run_all(client, shared_prefix_prompts(1)))
    assert rr_outputs == kv_outputs
    print(f"prefix hit tokens: kv {kv_hits}, round-robin {rr_hits} (ideal {ideal})")


PROMPTS = ["Once upon a time", "The quick brown fox", "Paged attention", "A scheduler"]
NUM_STREAMS, MAX_TOKENS = 128, 48


def stream_fields(i: int) -> dict:
    """Greedy streams, and seeded sampled ones (odd i), on a few prompts."""
    sampled = dict(temperature=0.8, top_p=0.95, seed=1000 + i) if i % 2 else dict(temperature=0.0)
    prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"
    return dict(prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **sampled)


async def run_streams(
    client: Client,
    tag: str,
    started: asyncio.Event | None = None,
    fields=stream_fields,
    num_streams: int = NUM_STREAMS,
) -> list:
    """`num_streams` streams at once; `started` is set once a sixteenth of them have 3 events
    (within the first wave of each instance)."""
    counts = [0] * num_streams

    async def one(i: int) -> list:
        events = []
        async for event in client.generate(request_id=f"{tag}-{i}", **fields(i)):
            events.append(event)
            counts[i] += 1
            if started is not None and sum(c >= 3 for c in counts) >= num_streams // 16:
                started.set()
        return events

    return await asyncio.gather(*(one(i) for i in range(num_streams)))


def token_fields(i: int) -> dict:
    """stream_fields(i) with a token-id prompt, which a client can continue exactly."""
    fields = stream_fields(i)
    del fields["prompt"]
    rng = random.Random(i)
    return dict(fields, prompt_token_ids=[rng.randrange(3, 300) for _ in range(4 + i % 9)])


def outputs(streams: list[list]) -> list[list[int]]:
    for events in streams:
        final = events[-1]
        assert final.is_final and final.error is None, final
        assert [e.seq for e in events] == list(range(len(events))), "a gap in seq"
        assert final.usage.num_completion_tokens == MAX_TOKENS
    return [[t for e in events for t in e.token_ids] for events in streams]


def count_logged(services: Services, name: str, text: str) -> int:
    return sum(text in line for line in services.log_lines(name))


async def until_logged(services: Services, name: str, text: str, count: int) -> None:
    for _ in range(600):
        if count_logged(services, name, text) >= count:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{name} did not log {text!r} {count} times")


async def kill_mid_stream(client: Client, replicas: Services, victim: str) -> None:
    """SIGKILL `victim` with every stream in flight: each goes on elsewhere, unchanged."""
    reference = outputs(await run_streams(client, f"{victim}-ref"))
    moves = count_logged(replicas, "tokenizer", "stream moves")
    started = asyncio.Event()
    run = asyncio.create_task(run_streams(client, victim, started))
    await asyncio.wait_for(started.wait(), 60.0)
    replicas.processes[victim].kill()
    replicas.processes[victim].wait()
    streams = await asyncio.wait_for(run, 60.0)
    assert outputs(streams) == reference  # greedy and seeded alike
    assert count_logged(replicas, "tokenizer", "stream moves") > moves, "nothing migrated"


async def test_executor_killed_streams_migrate(client: Client, replicas: Services):
    attached = count_logged(replicas, "scheduler-a", "executor attached")
    await kill_mid_stream(client, replicas, "executor-a")
    replicas.launch("executor-a", "executor", KVPAGER_INSTANCE="a")
    await until_logged(replicas, "scheduler-a", "executor attached", attached + 1)
    await until_instances(replicas)


async def test_scheduler_killed_streams_migrate(client: Client, replicas: Services):
    await kill_mid_stream(client, replicas, "scheduler-b")
    replicas.launch("scheduler-b", "scheduler", KVPAGER_INSTANCE="b")
    await until_logged(replicas, "scheduler-b", "executor attached", 1)
    await until_instances(replicas)


async def test_past_the_migration_limit_streams_end_with_a_typed_error(
    client: Client, replicas: Services
):
    """--migration-limit 0: a stream whose instance dies ends with migration_failed; the
    streams on the other instance are untouched."""
    replicas.processes["tokenizer"].terminate()
    assert replicas.processes["tokenizer"].wait(timeout=30) == 0
    replicas.launch("tokenizer", "tokenizer", KVPAGER_MIGRATION_LIMIT="0")
    await asyncio.to_thread(replicas.wait_healthy)
    await until_instances(replicas)
    attached = count_logged(replicas, "scheduler-a", "executor attached")
    started = asyncio.Event()
    run = asyncio.create_task(run_streams(client, "limit", started))
    await asyncio.wait_for(started.wait(), 60.0)
    replicas.processes["executor-a"].kill()
    replicas.processes["executor-a"].wait()
    streams = await asyncio.wait_for(run, 60.0)
    errors = [events[-1].error for events in streams]
    assert {e.type for e in errors if e is not None} == {"migration_failed"}, errors
    assert 0 < sum(e is not None for e in errors) < NUM_STREAMS, errors
    for events in streams:
        assert [e.seq for e in events] == list(range(len(events))), "a gap in seq"
    replicas.launch("executor-a", "executor", KVPAGER_INSTANCE="a")
    await until_logged(replicas, "scheduler-a", "executor attached", attached + 1)
    await until_instances(replicas)


IDLE_TIMEOUT_S = 3.0  # the client gives up on a stream silent this long (default 30 s)
NUM_TOKENIZER_STREAMS = NUM_STREAMS // 2  # half the work of the kill tests above: CI time


async def test_tokenizer_replica_killed_its_streams_end_connection_lost(
    client: Client, replicas: Services
):
    """A second tokenizer replica in the queue group, SIGKILLed with streams in flight: its
    streams end with the client's own connection_lost, the other replica's finish unchanged;
    sent again as the README says (the tokens so far appended to the prompt), the lost ones
    end as the reference did. The schedulers abort the dead replica's requests (the fixture
    checks that every block is free)."""
    reference = outputs(
        await run_streams(client, "tk-ref", None, token_fields, NUM_TOKENIZER_STREAMS)
    )
    launch_tokenizer(replicas, name="tokenizer-2")
    await until_logged(replicas, "tokenizer-2", "tokenizer ready", 1)
    await until_instances(replicas, "tokenizer-2")
    quick = await Client.connect(replicas.url, PREFIX, idle_timeout=IDLE_TIMEOUT_S)
    try:
        started = asyncio.Event()
        pending = run_streams(quick, "tk", started, token_fields, NUM_TOKENIZER_STREAMS)
        run = asyncio.create_task(pending)
        await asyncio.wait_for(started.wait(), 60.0)
        aborts = aborts_logged(replicas)
        victim = replicas.processes.pop("tokenizer-2")  # the module's teardown wants exit 0s
        victim.kill()
        victim.wait()
        streams = await asyncio.wait_for(run, 60.0)
        lost = lost_streams(streams, reference)
        check_owners(replicas, {f"tk-{i}" for i in lost}, NUM_TOKENIZER_STREAMS)
        assert aborts_logged(replicas) > aborts, "no scheduler noticed the replica gone"
        resumed = await asyncio.gather(*(resume(quick, i, streams[i]) for i in lost))
    finally:
        await quick.close()
    assert resumed == [reference[i] for i in lost]


def lost_streams(streams: list[list], reference: list[list[int]]) -> list[int]:
    """The indices of the streams that ended with connection_lost (their tokens so far a
    prefix of the reference's); every other one finished unchanged. Some of each."""
    lost = []
    for i, events in enumerate(streams):
        final = events[-1]
        assert final.is_final and [e.seq for e in events] == list(range(len(events))), final
        tokens = [t for e in events for t in e.token_ids]
        if final.error is None:
            assert tokens == reference[i] and final.finish_reason == "length", i
        else:
            assert final.error.type == "connection_lost", final.error
            assert tokens == reference[i][: len(tokens)], i
            lost.append(i)
    assert 0 < len(lost) < len(streams), lost
    return lost


def aborts_logged(services: Services) -> int:
    """How often the schedulers found a tokenizer replica gone (and aborted its requests)."""
    text = "tokenizer replica gone"
    return sum(count_logged(services, f"scheduler-{name}", text) for name in INSTANCES)


def logged_ids(services: Services, name: str, event: str) -> set[str]:
    """Request ids of `name`'s log lines for `event` (a SIGKILL may cut the last line)."""
    lines = [line for line in services.log_lines(name) if line.endswith("}")]
    records = [json.loads(line) for line in lines if f'"{event}"' in line]
    return {r["request_id"] for r in records if r.get("event") == event}


def check_owners(services: Services, lost: set[str], num_streams: int) -> None:
    """The lost streams are the dead replica's: none was queued by the live one, and every
    stream the dead one queued and had not finished is lost."""
    ids = {f"tk-{i}" for i in range(num_streams)}
    survivor = logged_ids(services, "tokenizer", "request queued") & ids
    queued = logged_ids(services, "tokenizer-2", "request queued") & ids
    finished = logged_ids(services, "tokenizer-2", "request finished")
    assert not lost & survivor, lost & survivor
    assert queued - finished <= lost, (queued - finished) - lost
    assert ids - lost <= survivor | finished, (ids - lost) - survivor - finished


async def resume(client: Client, i: int, events: list) -> list[int]:
    """What the README tells a client to do with a lost stream: send it again with the tokens
    received appended to the prompt, max_tokens lowered and seed_offset raised by as many.
    Its whole output: the tokens received, then the new stream's."""
    received = [t for e in events for t in e.token_ids]
    fields = token_fields(i)
    left = fields["max_tokens"] - len(received)
    if left == 0:  # every token came, only the final event did not
        return received
    prompt = fields["prompt_token_ids"] + received
    fields.update(prompt_token_ids=prompt, max_tokens=left, seed_offset=len(received))
    again = [e async for e in client.generate(request_id=f"tk-again-{i}", **fields)]
    assert again[-1].error is None and again[-1].finish_reason == "length", again[-1]
    return received + [t for e in again for t in e.token_ids]
