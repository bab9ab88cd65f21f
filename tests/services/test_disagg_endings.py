"""Disaggregated streams that end before the decode side reads their blocks: a stop string or
a stop token in the first token ends the stream on the prefill instance (the decode instance
computes nothing nobody sees), and a stream aborted while its continuation waits on the decode
instance (its executor stopped: the pull has not started) has the prefill instance free the
blocks it held at once, not when the hold expires (120 s). Every block is free on both
instances after, well within that expiry."""

import asyncio
import signal

import psutil
import pytest
from kvpager.engine.llm import LLM
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats

from tests.nats_server import free_port
from tests.services.kvpager_cli import start, wait_for_line
from tests.services.test_disaggregation import _prompt, _wait_for_log, _wait_idle

FREE_WITHIN_S = 15.0  # far below the 120 s a never-read hold waits
ENV = {"KVPAGER_LOG_LEVEL": "info"}  # to see the prefill find the decode instance


@pytest.fixture
def served(tiny_llama, tmp_path):
    """One prefill and one decode instance; blocks over NIXL when installed (else the NATS
    fallback). A stopped executor is not taken for lost in the time a test stops it."""
    port = free_port()
    env = {**ENV, "KVPAGER_LIVENESS_TIMEOUT": "60"}
    process = start(
        "serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "256",
        "--no-http", "--prefill-replicas", "1", "--decode-replicas", "1",
        log_dir=tmp_path, env=env,
    )  # fmt: skip
    try:
        wait_for_line(process, tmp_path / "out.txt", "kvpager: ready")
        _wait_for_log(tmp_path / "err.txt", "decode instances")  # the prefill found decode
        yield f"nats://127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except Exception:
                process.kill()
        process.wait()


async def _by_role(client: Client) -> dict:
    stats = await gather_stats(client.nc, "llm.stats", 1.0)
    return {s.instance.split("-")[-2]: s for s in stats}


async def _all_free(client: Client) -> dict:
    stats = await _wait_idle(client, FREE_WITHIN_S)
    for s in stats:
        assert s.num_used_blocks == 0 and s.num_running == s.num_waiting == 0, s
    return {s.instance.split("-")[-2]: s for s in stats}


async def _events(client: Client, **fields) -> list:
    return [event async for event in client.generate(prompt_token_ids=_prompt(0), **fields)]


def _first_token(tiny_llama) -> int:
    with LLM(str(tiny_llama), num_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        return llm.generate([_prompt(0)], params, use_tqdm=False)[0].outputs[0].token_ids[0]


def test_a_stream_that_stops_at_its_first_token_ends_on_the_prefill_instance(served, tiny_llama):
    first = _first_token(tiny_llama)

    async def run() -> None:
        client = await Client.connect(served[0], "llm")
        try:
            text = (await client.detokenize([first])).text
            assert text, "the first token shows no text: pick another prompt"
            greedy = dict(temperature=0.0, max_tokens=16)
            stopped = await _events(client, stop=[text], **greedy)
            assert stopped[-1].finish_reason == "stop" and stopped[-1].error is None, stopped
            assert stopped[-1].stop_reason == text
            by_token = await _events(client, stop_token_ids=[first], **greedy)
            assert by_token[-1].finish_reason == "stop", by_token
            assert [t for e in by_token for t in e.token_ids] == [first]
            roles = await _all_free(client)  # the held blocks went free at once
            decode = roles["decode"]
            assert decode.num_prompt_tokens == decode.num_generated_tokens == 0, decode
            assert decode.kv_transfer_blocks == 0, decode  # nothing handed on was read
            assert roles["prefill"].num_generated_tokens == 2, roles["prefill"]
        finally:
            await client.close()

    asyncio.run(run())


def _decode_executor(process) -> psutil.Process:
    for child in psutil.Process(process.pid).children(recursive=True):
        cmdline = " ".join(child.cmdline())
        if child.environ().get("KVPAGER_INSTANCE") == "default-decode-0" and "executor" in cmdline:
            return child
    raise AssertionError("no decode executor")


async def _prefill_until(client: Client, done, timeout_s: float = FREE_WITHIN_S):
    for _ in range(int(timeout_s / 0.1)):
        prefill = (await _by_role(client))["prefill"]
        if done(prefill):
            return prefill
        await asyncio.sleep(0.1)
    raise AssertionError(f"the prefill instance never got there: {prefill}")


async def _aborted_after_first_token(client: Client) -> None:
    """A stream aborted once its first token came and its prefill instance handed it on."""
    fields = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    stream = client.generate(prompt_token_ids=_prompt(0), **fields)
    event = await anext(stream)
    assert event.token_ids, event  # its first token, from the prefill instance
    # handed on: nothing runs there, its blocks held for the decode side to read
    await _prefill_until(client, lambda s: s.num_used_blocks > 0 and s.num_running == 0)
    await asyncio.sleep(0.5)  # the continuation reaches the decode instance
    await stream.aclose()  # the client aborts it


def test_a_stream_aborted_before_decode_reads_its_blocks_frees_them_at_once(served):
    """The decode instance's executor is stopped (SIGSTOP), so the pull cannot start: the
    blocks wait on the prefill instance until the abort frees them."""
    url, process = served
    executor = _decode_executor(process)

    async def run() -> None:
        client = await Client.connect(url, "llm")
        try:
            executor.suspend()
            try:
                await _aborted_after_first_token(client)
                freed = await _prefill_until(client, lambda s: s.num_used_blocks == 0, 5.0)
            finally:
                executor.resume()
            assert freed.num_generated_tokens == 1 and not freed.num_finished, freed
            roles = await _all_free(client)  # the decode side let its import go too
            assert roles["decode"].num_generated_tokens == 0, roles["decode"]
        finally:
            await client.close()

    asyncio.run(run())
