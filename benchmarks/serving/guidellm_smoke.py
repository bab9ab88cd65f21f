"""An unmodified guidellm (0.8.1) against `kvpager serve --http-port`: a short constant-rate
profile of synthetic chat requests, and its numbers.

    python -m benchmarks.serving.guidellm_smoke [--model smollm2-135m-instruct] [--rate 0.5]
        [--seconds 20] [--prompt-tokens 64] [--output-tokens 32]
        [--guidellm .venv-guidellm/bin/guidellm]

guidellm pins its own torch and friends, so it lives in a venv of its own (about 4 minutes to
install here, with the CPU torch kept by a constraint):

    python3 -m venv .venv-guidellm && echo torch==2.13.0 > /tmp/torch-pin.txt &&
      .venv-guidellm/bin/pip install guidellm==0.8.1 -c /tmp/torch-pin.txt

A fresh `kvpager serve` (embedded NATS, the gateway on a free port) serves `--model`; guidellm
sends what it always sends (`stream_options` with `continuous_usage_stats`, `ignore_eos`,
`max_completion_tokens`, text parts) and writes its JSON report, from which this prints the
requests completed, incomplete (still running at the end) and errored, TTFT, ITL and request
latency. Not a CI test: with guidellm's ~45 s of start-up and shutdown it runs past a minute.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from kvpager.engine.download import resolve_model
from kvpager.services.serve.processes import python_module

from benchmarks.serving.nats_peer import free_port, stop

DEFAULT_GUIDELLM = Path(__file__).parents[2] / ".venv-guidellm" / "bin" / "guidellm"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--guidellm", default=str(DEFAULT_GUIDELLM))
    return parser.parse_args(argv)


def start_serve(model: str, http_port: int) -> subprocess.Popen:
    command = python_module("kvpager.services.cli", "serve", "--model", model)
    command += ["--nats-port", str(free_port()), "--http-port", str(http_port)]
    env = {**os.environ, "KVPAGER_LOG_LEVEL": "warning"}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def wait_healthy(base_url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("kvpager serve did not become healthy")


def run_guidellm(args, base_url: str, model_name: str, tokenizer: str, report: Path) -> None:
    command = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={base_url},model={model_name}",
        "--profile", f"kind=constant,rate={args.rate}",
        "--constraint", f"kind=max_duration,seconds={args.seconds}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
        f"output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ]  # fmt: skip
    subprocess.run(command, check=True, timeout=args.seconds + 300)


def summary(report: Path) -> str:
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    lines = [
        f"requests: {totals['successful']} completed, {totals['incomplete']} incomplete, "
        f"{totals['errored']} errored"
    ]
    for name, key, unit in (
        ("TTFT", "time_to_first_token_ms", "ms"),
        ("ITL", "inter_token_latency_ms", "ms"),
        ("request latency", "request_latency", "s"),
    ):
        done = metrics[key]["successful"]
        p50, p95 = done["percentiles"]["p50"], done["percentiles"]["p95"]
        lines.append(f"{name}: p50 {p50:.1f} {unit}, p95 {p95:.1f} {unit} (completed requests)")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    model = resolve_model(args.model)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_serve(str(model), port)
    try:
        wait_healthy(base_url)
        served = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        with tempfile.TemporaryDirectory() as folder:
            report = Path(folder) / "guidellm.json"
            run_guidellm(args, base_url, served, str(model), report)
            print(f"guidellm constant@{args.rate}/s for {args.seconds} s against {served}")
            print(summary(report))
    finally:
        stop(server)


if __name__ == "__main__":
    main()
