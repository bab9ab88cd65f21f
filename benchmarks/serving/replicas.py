"""Replicas (issue #17, "Measure"): a multi-prefix workload over `kvpager serve --replicas 2`
routed kv, round-robin and least-loaded, and the same requests over one instance.

    python -m benchmarks.serving.replicas                     # SmolLM2-135M-Instruct, the full run
    python -m benchmarks.serving.replicas --rate inf          # every request at t = 0
    python -m benchmarks.serving.replicas --kv-cache-gib 0.1  # ~2,300 tokens an instance: tight
    python -m benchmarks.serving.replicas --model <folder> --systems 2 --users 2 --system-len 32

Every configuration (instances x router, at each --rate) gets a fresh `kvpager serve`, so each
starts with an empty prefix cache, and the same requests at the same times: token-id prompts
(a system prompt + a user's suffix), greedy, `ignore_eos`, sent at seeded Poisson arrivals.
Each instance runs --threads-per-instance threads (OMP_NUM_THREADS; every executor's own count
is read back from its "executor ready" log line before anything is sent). Measured at the
client: TTFT (send to first token), prefix hit rate (the final events' cached prompt tokens /
prompt tokens) and output tok/s (output tokens / first send to last final event).
"""

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from kvpager.kernels.isa import isa_flags
from kvpager.services.bench.load import ready
from kvpager.services.bench.metrics import SequenceTimes, percentiles
from kvpager.services.bench.workloads import BenchRequest, Workload, arrival_times, multi_prefix
from kvpager.services.http.metrics import gather_stats
from kvpager.services.settings import Settings

from benchmarks.common.config import BenchConfig
from benchmarks.common.machine import CpuWatch, cpu_name
from benchmarks.serving.nats_peer import free_port, serve, stop, stream, warm_up

# An estimate, for the full run to check: on the 2-core EPYC one thread prefilled SmolLM2-135M
# at ~350 tokens/s (a smoke run) and decodes a full batch at ~80 tok/s (benchmarks/reports/
# cpu-2core: 160 on 2 threads). A request here computes 32 output + ~55 prompt tokens (its
# suffix, its share of a system prompt), ~0.55 s of a thread: one instance serves ~1.8 req/s,
# two ~3 (the other services share the cores). At 2.5 two are busy but keep up, one falls
# behind; inf is the throughput ceiling.
DEFAULT_RATES = (2.5, math.inf)
ROUTERS = ("kv", "round-robin", "least-loaded")
SERVICE_ENV = {"KVPAGER_LOG_LEVEL": "info", "KVPAGER_LOG_JSON": "true"}


@dataclass(frozen=True)
class Setup:
    name: str
    replicas: int
    router: str


@dataclass(frozen=True)
class Sent:
    """One request, in seconds from the start of the run."""

    sent_at: float
    first_at: float
    done_at: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


def setups(replicas: int, routers: list[str]) -> list[Setup]:
    return [Setup("1 instance", 1, "kv")] + [
        Setup(f"{replicas} x {router}", replicas, router) for router in routers
    ]


def summarize(sent: list[Sent]) -> dict:
    """TTFT and end-to-end percentiles, prefix hit rate, output throughput over the run."""
    elapsed = max(s.done_at for s in sent)
    num_prompt = sum(s.num_prompt_tokens for s in sent)
    num_cached = sum(s.num_cached_tokens for s in sent)
    num_output = sum(s.num_output_tokens for s in sent)
    return {
        "elapsed_s": round(elapsed, 2),
        "num_requests": len(sent),
        "num_prompt_tokens": num_prompt,
        "num_cached_prompt_tokens": num_cached,
        "prefix_hit_rate": round(num_cached / num_prompt, 4),
        "num_output_tokens": num_output,
        "output_tokens_per_s": round(num_output / elapsed, 2),
        **percentiles("ttft_ms", [s.first_at - s.sent_at for s in sent]),
        **percentiles("e2e_ms", [s.done_at - s.sent_at for s in sent]),
    }


# --- one configuration --------------------------------------------------------------------


def run_setup(
    cfg: BenchConfig,
    setup: Setup,
    workload: Workload,
    offsets: list[float],
    log_path: Path,
    overlap_weight: float,
) -> dict:
    """A fresh `kvpager serve` for `setup`, the workload sent at `offsets`, then stopped."""
    port = free_port()
    with open(log_path, "wb") as log:
        env = {**SERVICE_ENV, "KVPAGER_ROUTER_OVERLAP_WEIGHT": str(overlap_weight)}
        server = serve(cfg, port, setup.replicas, setup.router, env, log)
    try:
        url = f"nats://127.0.0.1:{port}"
        return asyncio.run(_measure(url, server, cfg, setup, workload, offsets, log_path))
    finally:
        stop(server)


async def _measure(url, server, cfg, setup, workload, offsets, log_path: Path) -> dict:
    client = await ready(url, "llm")
    try:
        await _until_instances(client, setup.replicas, log_path)
        threads = [r["num_threads"] for r in _logged(log_path, "executor ready")]
        assert threads == [cfg.num_threads] * setup.replicas, f"executor threads: {threads}"
        await warm_up(client, 4 * setup.replicas)
        before = await gather_stats(client.nc, "llm.stats", 2.0)
        executors = [p for p in psutil.Process(server.pid).children(True) if _is_executor(p)]
        cpu = [_cpu_s(p) for p in executors]
        watch, start = CpuWatch(), time.perf_counter()
        sent = await asyncio.gather(
            *(
                _send(client, f"{workload.name}-{i}", request, at, start)
                for i, (request, at) in enumerate(zip(workload.requests, offsets))
            )
        )
        elapsed = time.perf_counter() - start
        other_cores = watch.other_cores()
        cores = [(_cpu_s(p) - s) / elapsed for p, s in zip(executors, cpu)]
        after = await gather_stats(client.nc, "llm.stats", 2.0)
    finally:
        await client.close()
    return {
        **summarize(sent),
        "instances": per_instance(before, after),
        "executor_threads": threads,
        "executor_cores": [round(c, 2) for c in cores],
        "other_cores": round(other_cores, 2),
    }


async def _send(client, request_id: str, request: BenchRequest, at: float, start: float) -> Sent:
    """Send `request` `at` seconds after `start`, and follow its stream."""
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent_at, seqs = time.perf_counter() - start, [SequenceTimes()]
    done_at, final = await stream(client, request_id, request, seqs, start)
    usage, times = final.usage, seqs[0].token_times
    cached = usage.num_cached_prompt_tokens
    return Sent(sent_at, times[0], done_at, usage.num_prompt_tokens, cached, len(times))


async def _until_instances(client, num_instances: int, log_path: Path, timeout_s=300.0) -> None:
    """Every instance answers llm.stats (its executor attached), and the tokenizer found it."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = {s.instance for s in await gather_stats(client.nc, "llm.stats", 1.0)}
        found = {r.get("instance") for r in _logged(log_path, "instance found")}
        if len(names) == num_instances and names <= found:
            return
        assert time.monotonic() < deadline, f"instances {sorted(names)}, routed to {found}"
        await asyncio.sleep(0.2)


def _logged(log_path: Path, event: str) -> list[dict]:
    """The services' JSON log records of `event`."""
    records = []
    for line in log_path.read_text().splitlines():
        if f'"{event}"' in line:
            try:
                records.append(json.loads(line))
            except ValueError:  # a traceback's line, say
                continue
    return [r for r in records if r.get("event") == event]


def _is_executor(process: psutil.Process) -> bool:
    try:
        return "executor" in process.cmdline()
    except psutil.Error:
        return False


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def per_instance(before: list, after: list) -> dict[str, dict]:
    """What each instance did during the run: requests, prefix hits, preemptions."""
    old = {s.instance: s for s in before}
    rows = {}
    for stats in after:
        prior = old.get(stats.instance)

        def grown(field: str, stats=stats, prior=prior) -> int:
            return getattr(stats, field) - (getattr(prior, field) if prior else 0)

        finished = sum(prior.num_finished.values()) if prior else 0
        rows[stats.instance] = {
            "num_requests": sum(stats.num_finished.values()) - finished,
            "prefix_cache_hit_tokens": grown("prefix_cache_hit_tokens"),
            "prefix_cache_queried_tokens": grown("prefix_cache_queried_tokens"),
            "num_preemptions": grown("num_preemptions"),
            "peak_running": stats.peak_running,
        }
    return rows


# --- the report -----------------------------------------------------------------------------


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def ratios(rows: list[dict], replicas: int) -> list[dict]:
    """Per rate: kv's TTFT over round-robin's and least-loaded's (under 1: kv is faster), and
    the multi-instance kv run's output tok/s over one instance's."""
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        by_name = {r["config"]: r for r in rows if r["rate"] == rate}
        kv, line = by_name.get(f"{replicas} x kv"), {"rate": rate}
        for other in ("round-robin", "least-loaded"):
            peer = by_name.get(f"{replicas} x {other}")
            for p in (50, 90):
                key = f"ttft_ms_p{p}"
                if kv and peer and peer[key]:
                    line[f"kv / {other} TTFT p{p}"] = round(kv[key] / peer[key], 3)
        single = by_name.get("1 instance")
        if kv and single:
            line[f"{replicas} / 1 instances out tok/s"] = round(
                kv["output_tokens_per_s"] / single["output_tokens_per_s"], 3
            )
        out.append(line)
    return out


COLUMNS = [
    ("config", "config"),
    ("rate", "rate req/s"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p90", "TTFT p90 ms"),
    ("prefix_hit_rate", "prefix hit rate"),
    ("output_tokens_per_s", "out tok/s"),
    ("elapsed_s", "elapsed s"),
    ("requests_per_instance", "requests per instance"),
    ("executor_cores", "executor cores"),
    ("other_cores", "other cores"),
]


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    lines = ["| " + " | ".join(title for _, title in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(key, "-")) for key, _ in columns) + " |")
    return lines


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = ["# kvpager replicas benchmark", "", f"`{meta['command']}`", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items() if key != "command"]
    lines += ["", "## Results", "", *_table(report["results"], COLUMNS), "", "## Ratios", ""]
    keys = list(dict.fromkeys(k for line in report["ratios"] for k in line))
    lines += _table(report["ratios"], [(k, k) for k in keys])
    lines += ["", *(f"- {note}" for note in NOTES), ""]
    return "\n".join(lines)


NOTES = [
    "TTFT: the client's send to its first token; at a finite rate requests go out at their "
    "Poisson times, at inf all at t = 0 (TTFT then includes queueing).",
    "prefix hit rate: sum of the final events' usage.num_cached_prompt_tokens / prompt tokens.",
    "out tok/s: output tokens / (first send to last final event); at a finite rate it cannot "
    "exceed what the rate offers, so the instances' ratio shows scaling only at inf or when "
    "one instance falls behind the rate.",
    "executor cores: each executor's CPU time / elapsed; other cores: CPU used by other "
    "programs meanwhile (0 = quiet).",
]


# --- the command ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.replicas", description=__doc__
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", default="smollm2-135m-instruct", help="name or folder")
    parser.add_argument("--systems", type=int, default=8, help="system prompts")
    parser.add_argument("--users", type=int, default=16, help="users per system prompt")
    parser.add_argument("--system-len", type=int, default=256, help="tokens of a system prompt")
    parser.add_argument("--suffix-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--rate", type=float, nargs="+", default=list(DEFAULT_RATES), help="req/s; inf: all at 0"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2, help="instances to compare with one")
    parser.add_argument("--threads-per-instance", type=int, default=1)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="per instance")
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    parser.add_argument(
        "--overlap-weight",
        type=float,
        default=Settings().router_overlap_weight,
        help="kv router's weight of a block to prefill (KVPAGER_ROUTER_OVERLAP_WEIGHT)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parents[1] / "results" / "replicas"
    )
    return parser.parse_args(argv)


def build_workload(args: argparse.Namespace, model_path: Path) -> Workload:
    from benchmarks.peers.run import token_source

    lengths = (args.system_len, tuple(args.suffix_len), args.output_len)
    return multi_prefix(
        token_source(model_path), args.systems, args.users, *lengths, seed=args.seed
    )


def main(argv: list[str] | None = None) -> int:
    from kvpager.engine.download import resolve_model

    args = parse_args(argv)
    started = time.perf_counter()
    model_path = resolve_model(args.model)
    workload = build_workload(args, model_path)
    cfg = BenchConfig(
        model_path=model_path,
        num_threads=args.threads_per_instance,
        kv_cache_gib=args.kv_cache_gib,
        seed=args.seed,
    )
    print(f"ISA flags: {' '.join(isa_flags()) or 'none'}", flush=True)
    print(f"workload: {workload.summary()}", flush=True)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    rows = []
    for rate in args.rate:
        offsets = arrival_times(len(workload.requests), rate, args.seed)
        for setup in setups(args.replicas, args.routers):
            label = _rate_label(rate)
            log_path = args.out / "logs" / f"{setup.name.replace(' ', '')}-rate{label}.log"
            row = {"config": setup.name, "rate": label}
            row.update(run_setup(cfg, setup, workload, offsets, log_path, args.overlap_weight))
            row["requests_per_instance"] = [i["num_requests"] for i in row["instances"].values()]
            rows.append(row)
            print(" ".join(f"{k}={row[k]}" for k, _ in COLUMNS), flush=True)
    report = {
        "meta": _meta(args, cfg, workload, started),
        "results": rows,
        "ratios": ratios(rows, args.replicas),
    }
    _write(report, args.out)
    return 0


def _meta(args: argparse.Namespace, cfg: BenchConfig, workload: Workload, started: float):
    return {
        "command": "python -m benchmarks.serving.replicas " + " ".join(sys.argv[1:]),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs",
        "isa_flags": " ".join(isa_flags()) or "none",
        "model": str(cfg.model_path),
        "workload": workload.summary(),
        "threads_per_instance": cfg.num_threads,
        "router_overlap_weight": args.overlap_weight,
        "kv_cache_gib_per_instance": cfg.kv_cache_gib,
        "dtype": cfg.dtype,
        "seed": args.seed,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _write(report: dict, out_dir: Path) -> None:
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (out_dir / "results.md").write_text(text)
    print("\n" + text)
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}, logs in {out_dir / 'logs'}")


if __name__ == "__main__":
    sys.exit(main())
