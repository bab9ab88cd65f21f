"""Prefill/decode disaggregation on `kvpager serve --prefill-replicas 1 --decode-replicas 1`:
the prefill instance computes every prompt and the first token, then hands the stream with
its KV blocks to the decode instance, which reads them and streams the rest. The client sees
one gap-free stream, token for token the offline engine's (greedy and seeded), over NIXL (when
installed) and over the NATS fallback; the decode instance computed no prompt of its own (its
prompt tokens all came as blocks) and every block is free on both instances after."""

import asyncio
import signal
import time

import pytest
from kvpager.engine.llm import LLM
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats
from kvpager.services.serve.launcher import instance_roles
from kvpager.services.settings import ServeSettings, Settings

from tests.nats_server import free_port
from tests.services.kvpager_cli import start, wait_for_line
from tests.services.test_drain_migration import _drain_request

NUM_STREAMS, NUM_TOKENS = 6, 24


@pytest.fixture(params=["auto", "nats"])
def served(tiny_llama, tmp_path, request):
    port = free_port()
    process = start(
        "serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "256",
        "--no-http", "--prefill-replicas", "1", "--decode-replicas", "1",
        "--kv-transfer", request.param, log_dir=tmp_path,
        env={"KVPAGER_LOG_LEVEL": "info"},  # to see the prefill find the decode instance
    )  # fmt: skip
    try:
        wait_for_line(process, tmp_path / "out.txt", "kvpager: ready")
        _wait_for_log(tmp_path / "err.txt", "decode instances")  # the prefill found decode
        yield f"nats://127.0.0.1:{port}"
        fallback = "kv transfer over NATS" in (tmp_path / "err.txt").read_text()
        assert fallback == (request.param == "nats" or not nixl.available())
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except Exception:
                process.kill()
        process.wait()


def _wait_for_log(path, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"no {text} in the log"
        time.sleep(0.1)


def _prompt(i: int) -> list[int]:
    return [10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i] * 5  # 35: 3 blocks


def _sampling(i: int) -> dict:
    return dict(temperature=0.0) if i % 2 else dict(temperature=1.0, top_p=0.9, seed=100 + i)


async def _stream(client: Client, i: int) -> list[int]:
    tokens, seqs, final = [], [], None
    fields = dict(max_tokens=NUM_TOKENS, ignore_eos=True, **_sampling(i))
    async for event in client.generate(prompt_token_ids=_prompt(i), **fields):
        tokens += event.token_ids
        seqs.append(event.seq)
        final = event
    assert final.finish_reason == "length" and final.error is None, final
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # gap-free
    return tokens


async def _parallel_samples(client: Client) -> dict[int, list[int]]:
    """n = 2 cannot move: it finishes on the prefill instance."""
    by_index: dict[int, list[int]] = {0: [], 1: []}
    fields = dict(n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=3)
    async for event in client.generate(prompt_token_ids=_prompt(9), **fields):
        assert event.error is None, event
        by_index[event.index] += event.token_ids
    return by_index


async def _wait_idle(client: Client, timeout_s: float = 20.0) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await gather_stats(client.nc, "llm.stats", 1.0)
        idle = all(s.num_used_blocks == 0 and not s.num_running for s in stats)
        if (idle and len(stats) == 2) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def _served(url: str) -> tuple[list[list[int]], list]:
    client = await Client.connect(url, "llm")
    try:
        outputs = await asyncio.gather(*(_stream(client, i) for i in range(NUM_STREAMS)))
        await _wait_idle(client)  # the handed-on blocks read and freed: cached on prefill
        assert await _stream(client, 1) == outputs[1]  # again: the prefill's cache serves it
        assert list(map(len, (await _parallel_samples(client)).values())) == [8, 8]
        return list(outputs), await _wait_idle(client)
    finally:
        await client.close()


def test_prefill_hands_streams_to_decode_with_their_blocks(served, tiny_llama):
    outputs, stats = asyncio.run(_served(served))
    with LLM(str(tiny_llama), num_blocks=256) as llm:
        params = [
            SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **_sampling(i))
            for i in range(NUM_STREAMS)
        ]
        offline = llm.generate([_prompt(i) for i in range(NUM_STREAMS)], params, use_tqdm=False)
    assert outputs == [o.outputs[0].token_ids for o in offline]
    by_role = {s.instance.split("-")[-2]: s for s in stats}
    prefill, decode = by_role["prefill"], by_role["decode"]
    assert prefill.kv_handoffs == NUM_STREAMS + 1, prefill  # each left after its 1st token
    num_blocks = -(-len(_prompt(0)) // decode.block_size)
    assert decode.kv_transfer_blocks == num_blocks * (NUM_STREAMS + 1), decode
    assert decode.kv_transfer_failed == 0, decode
    num_prompt = sum(len(_prompt(i)) for i in range(NUM_STREAMS + 1)) + len(_prompt(9))
    assert prefill.num_prompt_tokens == num_prompt, prefill
    # the decode instance computed only each continuation's first token (its prompt's last,
    # the prefill's sampled token): the blocks brought the rest
    assert decode.num_generated_tokens == (NUM_STREAMS + 1) * (NUM_TOKENS - 1), decode
    assert prefill.num_generated_tokens == NUM_STREAMS + 1 + 2 * 8, prefill  # n=2 stayed
    assert prefill.prefix_cache_hit_tokens >= 32, prefill  # the repeated prompt's full blocks
    assert decode.prefix_cache_hit_tokens == 0, decode  # imports are no cache hits
    for s in stats:
        assert s.num_used_blocks == 0 and s.num_running == s.num_waiting == 0, s


def test_roles_are_checked_and_named():
    with pytest.raises(ConfigError, match="role"):
        Settings(role="decoder")
    with pytest.raises(ConfigError, match="give both"):
        ServeSettings(prefill_replicas=1)
    roles = instance_roles(ServeSettings(prefill_replicas=1, decode_replicas=2))
    assert roles == ["prefill", "decode", "decode"]
    assert instance_roles(ServeSettings(replicas=2)) == ["both", "both"]


async def _prefill_stats(client: Client):
    stats = await gather_stats(client.nc, "llm.stats", 1.0)
    return next(s for s in stats if "-prefill-" in s.instance)


async def _one(client: Client, i: int) -> tuple[list[int], bool]:
    """A stream's tokens, and whether the prefill instance handed it on."""
    before = (await _prefill_stats(client)).kv_handoffs
    tokens = []
    async for event in client.generate(prompt_token_ids=_prompt(i), max_tokens=6, ignore_eos=True):
        assert event.error is None, event  # handed on as decode closed: it came back
        tokens += event.token_ids
    return tokens, (await _prefill_stats(client)).kv_handoffs > before


@pytest.mark.parametrize("served", ["nats"], indirect=True)
def test_with_the_decode_instance_drained_streams_finish_on_prefill(served):
    async def run() -> None:
        client = await Client.connect(served, "llm")
        try:
            assert (await _one(client, 0))[1]  # handed on while decode is up
            assert (await _drain_request(served, "default-decode-0")).num_moved == 0
            deadline = time.monotonic() + 15.0
            while (await _one(client, 1))[1]:  # until the prefill's look sees it closing
                assert time.monotonic() < deadline, "the prefill kept handing streams on"
            for i in range(3):
                tokens, handed_on = await _one(client, 2 + i)
                assert len(tokens) == 6 and not handed_on
            stats = await _wait_idle(client)
            assert all(s.num_used_blocks == 0 for s in stats), stats
        finally:
            await client.close()

    asyncio.run(run())
