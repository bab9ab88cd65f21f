"""kvpager through NATS: `kvpager serve` (an embedded nats-server and the tokenizer, scheduler and
executor processes) with the run's limits, and one client streaming every request at t = 0.

Each `run()` starts a fresh server and stops it afterwards, so every round starts with an empty
prefix cache, as the offline peer's does (it resets its cache between runs). Token-id prompts
with `ignore_eos`; each streamed event's tokens are stamped with the time the client received
them, so TTFT and ITL include tokenizer, scheduler, executor and two NATS hops.
"""

import asyncio
import os
import socket
import subprocess
import time
from typing import IO

from kvpager.schemas.public import GenerateEvent
from kvpager.services.bench.metrics import EngineResult, SequenceTimes
from kvpager.services.bench.workloads import BenchRequest, Workload
from kvpager.services.serve.processes import python_module

from benchmarks.common.config import BenchConfig
from benchmarks.common.machine import CpuWatch

ENGINE = "kvpager NATS"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(
    cfg: BenchConfig,
    port: int,
    replicas: int = 1,
    router: str = "kv",
    env: dict[str, str] | None = None,
    log: IO | None = None,
) -> subprocess.Popen:
    """`kvpager serve` on `port` with the run's limits (the KV budget is each instance's);
    `env` overrides the services' environment; their log lines go to `log` (default: ours)."""
    environ = {
        **os.environ,
        "KVPAGER_MODEL": str(cfg.model_path),
        "KVPAGER_DTYPE": cfg.dtype,
        "KVPAGER_BLOCK_SIZE": str(cfg.block_size),
        "KVPAGER_KV_CACHE_MEMORY": str(cfg.kv_cache_bytes),
        "KVPAGER_KV_CACHE_DTYPE": cfg.kv_cache_dtype,
        "KVPAGER_MAX_NUM_SEQS": str(cfg.max_num_seqs),
        "KVPAGER_MAX_NUM_BATCHED_TOKENS": str(cfg.max_num_batched_tokens),
        "KVPAGER_MAX_MODEL_LEN": str(cfg.max_model_len),
        "KVPAGER_ENABLE_PREFIX_CACHING": str(cfg.enable_prefix_caching).lower(),
        "KVPAGER_MAX_WAITING": "100000",
        "KVPAGER_SEED": str(cfg.seed),
        "KVPAGER_LOG_LEVEL": "warning",
        "KVPAGER_REPLICAS": str(replicas),
        "KVPAGER_ROUTER": router,
        "OMP_NUM_THREADS": str(cfg.num_threads),  # every service's, each executor's too
        **(env or {}),
    }
    command = python_module("kvpager.services.cli", "serve", "--nats-port", str(port), "--no-http")
    return subprocess.Popen(command, env=environ, stdout=subprocess.DEVNULL, stderr=log)


def stop(server: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM (the services drain), SIGKILL after `timeout_s`."""
    server.terminate()
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


async def stream(
    client, request_id: str, request: BenchRequest, seqs, start: float
) -> tuple[float, GenerateEvent]:
    """One request's stream; each event's tokens stamped into `seqs` (if given) on arrival,
    in seconds from `start`. Returns when its final event came, and that event."""
    events = client.generate(
        request_id=request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        max_tokens=request.max_tokens,
        n=request.n,
        temperature=request.temperature,
        seed=request.seed,
        ignore_eos=True,
    )
    async for event in events:
        now = time.perf_counter() - start
        if event.error is not None:
            raise RuntimeError(f"{request_id}: {event.error.type}: {event.error.message}")
        if seqs is not None:
            seqs[event.index].token_times.extend([now] * len(event.token_ids))
    return time.perf_counter() - start, event


async def warm_up(client, num_requests: int = 4) -> None:
    """Short requests so first-call costs (allocator, kernel build check) stay off the clock;
    with several instances, enough that each gets some."""
    requests = [BenchRequest([100 + i] * (8 + 8 * (i % 4)), 8) for i in range(num_requests)]
    await asyncio.gather(*(stream(client, f"warm-{i}", r, None, 0) for i, r in enumerate(requests)))


class NatsPeer:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()

    def run(self, workload: Workload) -> list[EngineResult]:
        port = free_port()
        server = serve(self.cfg, port)
        try:
            return [self.loop.run_until_complete(self._run(workload, port))]
        finally:
            stop(server)

    async def _run(self, workload: Workload, port: int) -> EngineResult:
        from kvpager.services.bench.load import ready  # the load client's wait for a healthy server

        client = await ready(f"nats://127.0.0.1:{port}", "llm")
        try:
            await warm_up(client)
            stats_before = await client.stats()
            sequences = {
                i: [SequenceTimes() for _ in range(r.n)] for i, r in enumerate(workload.requests)
            }
            watch = CpuWatch()
            start = time.perf_counter()
            ends = await asyncio.gather(
                *(
                    stream(client, f"{workload.name}-{i}", r, sequences[i], start)
                    for i, r in enumerate(workload.requests)
                )
            )
            elapsed = time.perf_counter() - start
            other_cores = watch.other_cores()  # while the services still count as children
            stats = await client.stats()
        finally:
            await client.close()
        produced = sum(len(s.token_times) for seqs in sequences.values() for s in seqs)
        assert produced == workload.num_output_tokens, f"{produced} != {workload.num_output_tokens}"
        return EngineResult(
            ENGINE,
            workload.name,
            self.cfg.dtype,
            elapsed_s=elapsed,
            num_requests=len(workload.requests),
            num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=workload.num_output_tokens,
            sequences=sequences,
            finish_times=[finish_s for finish_s, _ in ends],
            latency_source="per streamed event, at the client",
            extra={
                "num_blocks": stats.num_blocks,
                "num_preemptions": stats.num_preemptions - stats_before.num_preemptions,
                "other_cores": round(other_cores, 2),
                # the executor's idle time between back-to-back steps (scheduler + NATS)
                "executor_wait_ms_mean": stats.executor_wait_ms.mean,
                "executor_wait_ms_p90": stats.executor_wait_ms.p90,
                "step_ms_mean": stats.step_ms.mean,
            },
        )

    def close(self) -> None:
        self.loop.close()
