"""`kvpager serve --tensor-parallel-size 2` on a real nats-server: its streams equal the
offline engine's at one rank, and a rank killed mid-stream fails every stream fast and typed,
after which serve restarts the executor with a fresh rank."""

import asyncio
import signal
import time

import psutil
import pytest
from kvpager.engine import LLM, SamplingParams
from kvpager.schemas.errors import ConfigError
from kvpager.services.client import Client
from kvpager.services.settings import Settings

from tests.models import CORPUS
from tests.nats_server import free_port
from tests.services.kvpager_cli import kvpager, start, wait_for_line

PROMPTS = [CORPUS[i][: 12 + 9 * i] for i in range(6)]
TP_ENV = {"KVPAGER_HEARTBEAT_INTERVAL": "0.25", "KVPAGER_TENSOR_PARALLEL_TIMEOUT": "4"}


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    port = free_port()
    log_dir = tmp_path_factory.mktemp("serve-tp")
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "64"]
    process = start(*args, "--no-http", "--tensor-parallel-size", "2", log_dir=log_dir, env=TP_ENV)
    try:
        wait_for_line(process, log_dir / "out.txt", "kvpager: ready")
        yield process, f"nats://127.0.0.1:{port}", log_dir
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def _events(stream) -> list:
    return [event async for event in stream]


def _rank_process(serve: psutil.Process, rank: str) -> psutil.Process:
    for child in serve.children(recursive=True):
        if child.environ().get("RANK") == rank:
            return child
    raise AssertionError(f"no rank {rank} under the serve process")


async def test_streams_equal_offline_at_one_rank(served, tiny_llama):
    _, url, _ = served
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i) for i in range(len(PROMPTS))]
    with LLM(str(tiny_llama), seed=0) as offline:
        expected = offline.generate(PROMPTS, params, use_tqdm=False)
    client = await Client.connect(url)
    try:
        results = await asyncio.gather(
            *(
                _events(client.generate(prompt=p, temperature=0.0, max_tokens=sp.max_tokens))
                for p, sp in zip(PROMPTS, params)
            )
        )
        for events, want in zip(results, expected):
            assert [t for e in events for t in e.token_ids] == want.outputs[0].token_ids
            assert "".join(e.text for e in events) == want.outputs[0].text
        stats = await client.stats()
        assert stats.num_blocks == 64 and stats.num_used_blocks == 0, stats
    finally:
        await client.close()


async def test_a_killed_rank_ends_every_stream_typed_within_5s(served):
    """SIGKILL of rank 1 mid-stream: every stream ends with executor_unavailable, the executor
    (rank 0) exits with status 3, serve restarts it with a new rank 1, and it serves again."""
    process, url, log_dir = served
    serve = psutil.Process(process.pid)
    client = await Client.connect(url)
    try:
        reference = await _events(client.generate(prompt=PROMPTS[0], max_tokens=8))
        fields = dict(temperature=0.0, max_tokens=900, ignore_eos=True)
        tasks = [asyncio.create_task(_events(client.generate(prompt=p, **fields))) for p in PROMPTS]
        await asyncio.sleep(1.0)  # streaming by now
        assert not any(task.done() for task in tasks)
        killed = _rank_process(serve, "1")
        killed_at = time.monotonic()
        killed.send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert time.monotonic() - killed_at < 5.0
        finals = [events[-1] for events in results]
        assert all(final.is_final for final in finals)
        assert {final.error.type for final in finals} == {"executor_unavailable"}, finals
        again = await _until_served(client, PROMPTS[0], timeout_s=60.0)
        assert [e.token_ids for e in again] == [e.token_ids for e in reference]
    finally:
        await client.close()
    assert "the executor exited with code 3; restarting it" in (log_dir / "out.txt").read_text()
    assert _rank_process(serve, "1").pid != killed.pid


async def _until_served(client: Client, prompt: str, timeout_s: float) -> list:
    """A completion once the restarted executor (and its new rank 1) has attached."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = await _events(client.generate(prompt=prompt, max_tokens=8))
        if events[-1].error is None or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.5)


def test_bad_sizes_stop_serve_before_anything_starts(tiny_llama):
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be at least 1"):
        Settings(tensor_parallel_size=0)
    args = ["serve", "--model", str(tiny_llama), "--tensor-parallel-size", "3"]
    done = kvpager(*args, "--nats-port", str(free_port()), "--no-http")
    message = "tensor_parallel_size: 3 does not divide num_attention_heads 4"
    assert done.returncode == 2 and message in done.stderr, done.stderr
