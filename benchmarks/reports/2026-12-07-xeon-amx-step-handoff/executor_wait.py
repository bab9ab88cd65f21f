"""The executor's idle time between steps, served at saturation: `kvpager serve` (bf16, the
serve_bench settings), a warm-up, then RUNS runs of 64 random 256/128 requests at once through
`vllm bench serve` (each its own prompts, so none starts on cached blocks); then the
scheduler's `step_ms` and `executor_wait_ms` percentiles over all of them (`kvpager stats`).

    python benchmarks/reports/2026-12-07-xeon-amx-step-handoff/executor_wait.py OUT [RUNS]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: benchmarks
from kvpager.engine.download import resolve_model  # noqa: E402
from kvpager.services.serve.processes import python_module  # noqa: E402

from benchmarks.serving import serve_bench  # noqa: E402
from benchmarks.serving.nats_peer import free_port, stop  # noqa: E402
from benchmarks.serving.servers import wait_http  # noqa: E402


def main() -> None:
    out, runs = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(
        model=resolve_model("smollm2-135m-instruct"), dtype="bfloat16", threads=2, kv_gib=4,
        max_num_seqs=64, max_model_len=2048, kvpager_args="",
        vllm_python=Path("/tmp/vllm-venv/bin/python"), goodput=["ttft:2000", "tpot:100"],
        top_p=None,
    )  # fmt: skip
    port, nats_port = free_port(), free_port()
    serve_bench.free_port = lambda: nats_port  # the server's NATS port, for `kvpager stats`
    with open(out / "server.log", "w") as log:
        server = serve_bench.kvpager_server(args, port, log)
        try:
            wait_http(server, port)
            serve_bench.bench(args, port, "random", "inf", 8, out / "warm", 64)
            for i in range(runs):
                seed = 100 + i  # its own prompts
                r = serve_bench.bench(args, port, "random", "inf", 64, out / f"run{i}", 64, seed)
                ttft, tpot = r["median_ttft_ms"], r["median_tpot_ms"]
                print(f"run {i}: out tok/s {r['output_throughput']:.1f}, "
                      f"TTFT p50 {ttft:.0f} ms, TPOT p50 {tpot:.1f} ms")  # fmt: skip
            command = ["stats", "--json", "--nats-url", f"nats://127.0.0.1:{nats_port}"]
            stats = subprocess.run(python_module("kvpager.services.cli") + command,
                                   capture_output=True, text=True, check=True)  # fmt: skip
            figures = json.loads(stats.stdout)
            print("step_ms", figures["step_ms"])
            print("executor_wait_ms", figures["executor_wait_ms"])
        finally:
            stop(server, timeout_s=60)


if __name__ == "__main__":
    main()
