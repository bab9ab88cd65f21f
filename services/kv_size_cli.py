"""`kvpager kv-size`: KV-cache bytes per token and sequences per memory budget, for a
checkpoint's config (engine/kv/kv_size.py, engine/kv/recurrent_size.py), before any serving."""

import argparse
from collections.abc import Callable

from kvpager.schemas.errors import ConfigError


def _cmd_kv_size(args: argparse.Namespace) -> int:
    from kvpager.engine.kv.kv_size import gpu_kv_budget, kv_size, weight_bytes_per_rank
    from kvpager.engine.model_config import ModelConfig, dtype_name, kv_cache_dtype_name

    if _kv_size_recurrent(args):
        return 0
    config = ModelConfig.from_path(args.model)
    dtype = kv_cache_dtype_name(args.kv_cache_dtype or args.dtype or config.checkpoint_dtype)
    weight_dtype = dtype_name(config.checkpoint_dtype)
    size, gpus = _kv_size_ranks(args, config)
    budget = int(args.budget_gib * 1024**3)
    if gpus:
        budget = gpu_kv_budget(config, weight_dtype, args.gpu_memory, args.gpu_utilization, size)
        weights = weight_bytes_per_rank(config, weight_dtype, size)
        print(
            f"weights per rank:          {weights:,} ({weights / 1024**3:.2f} GiB, "
            f"{config.checkpoint_dtype}); tensor parallel {size} on {gpus} GPUs of "
            f"{args.gpu_memory / 1024**3:.2f} GiB, {args.gpu_utilization:.0%} usable"
        )
    report = kv_size(
        config,
        dtype,
        max_tokens=args.tokens,
        users=args.users,
        budget_bytes=budget,
        avg_tokens=args.avg_tokens or args.tokens // 2,
        block_size=args.block_size,
        tensor_parallel_size=size,
        replicas=max(1, gpus // size),
    )
    print("\n".join(report.lines()))
    return 0


def _kv_size_recurrent(args: argparse.Namespace) -> bool:
    """Recurrent hybrids (Mamba2, gated DeltaNet): their state bytes per sequence beside the
    attention layers' KV bytes per token (engine/kv/recurrent_size.py); False for others."""
    import json
    from pathlib import Path

    from kvpager.engine.kv.recurrent_size import hybrid_size
    from kvpager.engine.model_config import kv_cache_dtype_name

    path = Path(args.model)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        return False  # ModelConfig.from_path says why
    raw = json.loads(config_file.read_text())
    size = hybrid_size(raw, args.tensor_parallel_size or args.gpus or 1)
    if size is None:
        return False
    checkpoint = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    dtype = kv_cache_dtype_name(args.kv_cache_dtype or args.dtype or checkpoint)
    # the states are in the model's dtype, also beside an fp8 KV cache
    state_dtype = dtype if not dtype.startswith("float8") else kv_cache_dtype_name(checkpoint)
    budget = int(args.budget_gib * 1024**3)
    lines = size.lines(dtype, args.tokens, budget, state_dtype, args.users, args.block_size)
    print("\n".join(lines))
    return True


def _kv_size_ranks(args: argparse.Namespace, config) -> tuple[int, int]:
    """(tensor_parallel_size, GPUs): --gpus alone shards the model over all of them."""
    size = args.tensor_parallel_size or args.gpus or 1
    if args.gpus and args.gpus % size:
        raise ConfigError(f"gpus: {args.gpus} is not a multiple of tensor_parallel_size {size}")
    config.check_tensor_parallel(size)
    return size, args.gpus or 0


def add_parser(sub) -> dict[str, Callable]:
    from kvpager.engine.kv.kv_size import parse_bytes

    parser = sub.add_parser("kv-size", help="KV-cache bytes and sequences per memory budget")
    parser.add_argument("model", help="checkpoint folder or config.json")
    parser.add_argument("--tokens", type=int, default=4096, help="max tokens per sequence")
    parser.add_argument("--users", type=int, default=256, help="concurrent sequences")
    parser.add_argument(
        "--dtype",
        default=None,
        help="the KV cache's dtype: fp8 (= fp8_e4m3) | fp8_e5m2 | bf16 | ... (default: the "
        "checkpoint's); the weights are counted in the checkpoint's dtype either way",
    )
    parser.add_argument(
        "--kv-cache-dtype", default=None, help="the same as --dtype, by serve's name"
    )
    parser.add_argument(
        "--budget-gib", type=float, default=80.0, help="KV memory budget (of one rank)"
    )
    parser.add_argument(
        "--avg-tokens",
        type=int,
        default=None,
        help="average sequence length under paging (default: tokens / 2)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=None, help="ranks a model")
    parser.add_argument(
        "--gpus", type=int, default=None, help="GPUs (the budget is theirs less the weights)"
    )
    parser.add_argument("--gpu-memory", type=parse_bytes, default="80GiB", help="e.g. 80GiB")
    parser.add_argument(
        "--gpu-utilization", type=float, default=0.9, help="usable share of each GPU's memory"
    )
    return {"kv-size": _cmd_kv_size}
