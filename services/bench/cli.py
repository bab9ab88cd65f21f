"""`kvpager bench serve | throughput | latency`: the parsers and what each runs.

    kvpager bench serve --base-url http://127.0.0.1:8000 --model NAME --tokenizer PATH \
        --num-prompts 200 --input-len 256 --output-len 128 --request-rate 4 --max-concurrency 32
    kvpager bench serve --backend nats --nats-url nats://127.0.0.1:4222 --num-prompts 100
    kvpager bench throughput --model PATH --num-prompts 64 --input-len 128 --output-len 64
    kvpager bench latency --model PATH --batch-size 8 --input-len 32 --output-len 128
"""

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvpager.schemas.errors import ConfigError
from kvpager.services.bench.http import BenchHttpError, OpenAIBackend, get_json
from kvpager.services.bench.metrics import format_summary, serve_summary
from kvpager.services.bench.serve import given_requests, random_requests, run_benchmark
from kvpager.services.bench.workloads import BenchRequest, TokenSource


def add_parsers(sub) -> dict[str, Callable]:
    """`bench` and its three subcommands under the `kvpager` parser's subparsers."""
    bench = sub.add_parser("bench", help="benchmark a running server or the offline engine")
    modes = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve(modes.add_parser("serve", help="TTFT, TPOT, ITL and tok/s of a running server"))
    throughput = modes.add_parser("throughput", help="offline tokens/s on N prompts")
    latency = modes.add_parser("latency", help="offline end-to-end latency of one batch")
    for parser in (throughput, latency):
        _add_offline(parser)
    throughput.add_argument("--num-prompts", type=int, default=100)
    latency.add_argument("--batch-size", type=int, default=8)
    latency.add_argument("--num-iters", type=int, default=10)
    latency.add_argument("--num-iters-warmup", type=int, default=1)
    return {"bench": _cmd_bench}


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens a request")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens a request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")


def _add_serve(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--backend", choices=["openai", "nats"], default="openai")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="openai backend")
    parser.add_argument("--model", help="the served model's name (openai; default: the first)")
    parser.add_argument("--api-key", help="bearer token for the openai backend")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="nats backend")
    parser.add_argument("--prefix", default="llm", help="nats backend's subject prefix")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="req/s")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--tokenizer", help="tokenizer folder or name: the vocabulary and given prompts' ids"
    )
    parser.add_argument("--vocab-size", type=int, help="random ids below this, without one")
    parser.add_argument("--prompt", action="append", help="a given prompt (repeatable)")


def _add_offline(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--model", required=True, help="checkpoint folder or known model name")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized)")


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        try:
            figures = asyncio.run(_serve(args))
        except (OSError, TimeoutError, BenchHttpError) as exc:
            print(f"kvpager bench: no server to measure: {exc}", file=sys.stderr)
            return 1
        print(format_summary(figures))
        for error in figures["errors"]:
            print(f"failed: {error}", file=sys.stderr)
    else:
        figures = _offline(args)
        print(_format_offline(args.bench_command, figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


async def _serve(args: argparse.Namespace) -> dict:
    if args.backend == "nats":
        from kvpager.services.bench.load import NatsBackend, ready

        client = await ready(args.nats_url, args.prefix, timeout_s=30.0)
        try:
            card = (await client.models()).models[0]
            requests = _requests(args, args.vocab_size or card.vocab_size)
            outcomes, duration = await _run(args, NatsBackend(client), requests)
        finally:
            await client.close()
    else:
        model = args.model or (await get_json(args.base_url + "/v1/models"))["data"][0]["id"]
        requests = _requests(args, args.vocab_size)
        backend = OpenAIBackend(args.base_url.rstrip("/"), model, args.api_key)
        outcomes, duration = await _run(args, backend, requests)
    return serve_summary(outcomes, duration)


async def _run(args: argparse.Namespace, backend, requests: list[BenchRequest]):
    return await run_benchmark(
        backend, requests, args.request_rate, args.max_concurrency, args.seed
    )


def _requests(args: argparse.Namespace, vocab_size: int | None) -> list[BenchRequest]:
    """Given prompts (tokenized), else random ids of the tokenizer's or the given vocabulary."""
    tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
    if args.prompt:
        if tokenizer is None:
            raise ConfigError("--prompt needs --tokenizer (the ids the server is sent)")
        prompts = [tokenizer.encode(text) for text in args.prompt]  # BOS as a server adds it
        return given_requests(prompts, args.num_prompts, args.output_len)
    if tokenizer is not None:
        source = TokenSource(len(tokenizer), frozenset(tokenizer.all_special_ids))
    elif vocab_size:
        source = TokenSource(vocab_size, frozenset())
    else:
        raise ConfigError("random prompts need --tokenizer or --vocab-size")
    return random_requests(source, args.num_prompts, args.input_len, args.output_len, args.seed)


def _tokenizer(name: str):
    from kvpager.engine.download import resolve_model
    from transformers import AutoTokenizer

    path = Path(name) if Path(name).is_dir() else resolve_model(name)
    return AutoTokenizer.from_pretrained(str(path))


def _offline(args: argparse.Namespace) -> dict:
    from kvpager.engine import LLM
    from kvpager.services.bench import offline

    engine_args = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed)
    engine_args.update(max_model_len=args.max_model_len, num_blocks=args.num_blocks)
    llm = LLM(args.model, **engine_args)
    if args.bench_command == "throughput":
        prompts = offline.random_prompts(llm, args.num_prompts, args.input_len, args.seed)
        return offline.throughput(llm, prompts, args.output_len)
    prompts = offline.random_prompts(llm, args.batch_size, args.input_len, args.seed)
    return offline.latency(llm, prompts, args.output_len, args.num_iters, args.num_iters_warmup)


def _format_offline(command: str, figures: dict) -> str:
    if command == "throughput":
        return (
            f"Throughput: {figures['requests_per_s']:.2f} requests/s, "
            f"{figures['total_tokens_per_s']:.2f} total tokens/s, "
            f"{figures['output_tokens_per_s']:.2f} output tokens/s"
        )
    lines = [f"Avg latency: {figures['avg_latency_s']:.4f} seconds"]
    lines += [f"{k[1:-10]}% percentile latency: {v:.4f} seconds" for k, v in figures.items()
              if k.endswith("_latency_s") and k.startswith("p")]  # fmt: skip
    return "\n".join(lines)
