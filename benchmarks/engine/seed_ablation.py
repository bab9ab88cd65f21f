"""The seed's claim at a seed-like workload: paged KV + prefix sharing against contiguous
max-length reservation, at one fixed KV memory, on one engine.

The seed's scenario (many users, lengths up to the model's limit, one shared system prompt)
scaled to a 2-core host: `-n` users behind one system prompt, each with a suffix and an output
drawn so that a sequence reaches at most `--max-model-len` tokens, all arriving at t = 0. The
KV budget holds `--reservations` max-length sequences, so a contiguous cache admits that many
at a time. Arms (benchmarks/engine/ablation.py builds them; same model, executor, token budget):

- paged + prefix sharing: blocks on demand, the system prompt's blocks shared by every user;
- paged, no sharing;
- contiguous, prompt + max_tokens (an oracle that knows each output length);
- contiguous, max_model_len (what a pre-paging server reserves).

Prints, per arm: requests admitted at once (peak running), output tokens/s, TTFT p50/p99, and
each arm's ratio against the max_model_len reservation, with the host's ISA flags.

    python -m benchmarks.engine.seed_ablation                 # 48 users, bf16, ~5 minutes
    python -m benchmarks.engine.seed_ablation --quick         # 12 users, shorter lengths
"""

import argparse

import torch
from kvpager.engine.download import resolve_model
from kvpager.engine.kv.block_manager import BlockManager
from kvpager.kernels.isa import isa_flags
from kvpager.services.bench.workloads import Workload, shared_prefix

from benchmarks.common.config import BenchConfig
from benchmarks.engine.ablation import contiguous_arms, run_arms
from benchmarks.engine.kvpager_offline import build_llm
from benchmarks.peers.run import token_source

COLUMNS = [
    ("admitted at once", "peak_running", "{:.0f}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT p50 s", "ttft_p50_s", "{:.2f}"),
    ("TTFT p99 s", "ttft_p99_s", "{:.2f}"),
    ("elapsed s", "elapsed_s", "{:.1f}"),
]


def seed_workload(args, source) -> Workload:
    """Suffix and output ranges that bring the longest sequence to max_model_len."""
    room = args.max_model_len - args.system_len
    suffix = (room // 16, room // 2)
    output = (room // 32, room - suffix[1])
    return shared_prefix(source, args.num_users, args.system_len, suffix, output, args.seed)


def arms(cfg: BenchConfig, num_blocks: int) -> dict:
    bs = cfg.block_size
    return {
        "paged + prefix sharing": lambda: BlockManager(num_blocks, bs, True, 0),
        "paged, no sharing": lambda: BlockManager(num_blocks, bs, False, 0),
        **contiguous_arms(cfg, num_blocks),
    }


def row(result) -> dict:
    s = result.summary()
    values = {**s, **result.extra}
    values["ttft_p50_s"] = s["ttft_ms_p50"] / 1e3
    values["ttft_p99_s"] = s["ttft_ms_p99"] / 1e3
    return values


def table(rows: list[dict]) -> str:
    base = rows[-1]  # the max_model_len reservation
    head = "| arm | " + " | ".join(c[0] for c in COLUMNS) + " | tok/s vs contiguous |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in rows:
        cells = " | ".join(fmt.format(r[key]) for _, key, fmt in COLUMNS)
        ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        lines.append(f"| {r['arm']} | {cells} | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("-n", "--num-users", type=int, default=48)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--reservations", type=int, default=8, help="KV budget, in max-length sequences"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="12 users, 512-token limit")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_users, args.system_len, args.max_model_len = 12, 128, 512
    torch.set_num_threads(args.threads)
    model_path = resolve_model(args.model)
    cfg = BenchConfig(
        model_path, dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len
    )
    num_blocks = args.reservations * -(-args.max_model_len // cfg.block_size)
    workload = seed_workload(args, token_source(model_path))
    print(f"ISA flags: {' '.join(isa_flags()) or 'none'}")
    print(f"workload: {workload.summary()}")
    print(f"KV budget: {num_blocks} blocks of {cfg.block_size} = {args.reservations} x "
          f"{args.max_model_len} tokens; {args.dtype}, {args.threads} threads")  # fmt: skip
    llm = build_llm(cfg, num_blocks=num_blocks, enable_prefix_caching=True)
    results = run_arms(llm, workload, cfg, arms(cfg, num_blocks))
    rows = [{**row(r), "arm": r.extra["arm"]} for r in results]
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
