"""The `kvpager` command: one subcommand per job, each a thin call into engine or services."""

import argparse
import asyncio
import sys
from collections.abc import Callable

from kvpager.schemas.errors import ConfigError, KvpagerError
from kvpager.services.bench.cli import add_parsers as add_bench_parsers
from kvpager.services.client import ClientError
from kvpager.services.dynamo.main import add_parser as add_dynamo_parser
from kvpager.services.dynamo.main import run as run_dynamo
from kvpager.services.http.settings import HttpSettings
from kvpager.services.kv_size_cli import add_parser as add_kv_size_parser
from kvpager.services.settings import (
    CONNECTION_FIELDS,
    DEFAULT_MODEL,
    ServeSettings,
    Settings,
    add_arguments,
    configured,
)


def _cmd_download(args: argparse.Namespace) -> int:
    from kvpager.engine.download import resolve_model

    print(resolve_model(args.model or configured("model") or DEFAULT_MODEL, progress=True))
    return 0


def _cmd_offline(args: argparse.Namespace) -> int:
    from kvpager.engine.llm import LLM
    from kvpager.schemas.sampling import SamplingParams

    _warn_ignored(args)
    llm = LLM(
        args.model,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
    )
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate(args.prompt, params)
    print(outputs[0].outputs[0].text)
    return 0


def _cmd_service(args: argparse.Namespace) -> int:
    settings = Settings.from_args(args)
    if args.command == "tokenizer":
        from kvpager.services.tokenizer.main import run
    elif args.command == "scheduler":
        from kvpager.services.scheduler.main import run
    else:
        from kvpager.services.executor.main import run
    return run(settings)


def _cmd_http(args: argparse.Namespace) -> int:
    from kvpager.services.http.main import run

    return run(Settings.from_args(args), HttpSettings.from_args(args), args.command == "metrics")


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvpager.services.serve.launcher import serve

    _take_positional_model(args)
    _warn_ignored(args)
    embedded = args.nats_url is None
    if embedded:  # a placeholder until the embedded server knows its URL
        args.nats_url = Settings.nats_url
    settings, options = Settings.from_args(args), ServeSettings.from_args(args)
    return serve(settings, options, embedded, HttpSettings.from_args(args))


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvpager.services import terminal

    request = terminal.request_for(
        args.prompt,
        args.chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    return asyncio.run(terminal.generate(Settings.from_args(args), request))


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvpager.services import terminal

    return asyncio.run(terminal.stats(Settings.from_args(args), args.json, args.watch))


def _cmd_health(args: argparse.Namespace) -> int:
    from kvpager.services import terminal

    return asyncio.run(terminal.health(Settings.from_args(args), args.timeout))


def _cmd_drain(args: argparse.Namespace) -> int:
    from kvpager.services import terminal

    return asyncio.run(terminal.drain(Settings.from_args(args), args.name, args.timeout))


def _cmd_credentials(args: argparse.Namespace) -> int:
    from kvpager.services import credentials

    path, existed = credentials.add_client(args.name, args.prefix)
    identity = credentials.load(path)
    reloaded = credentials.reload_servers()
    print(f"{'kept' if existed else 'created'} {path} (mode 0600): NATS user {identity.user!r}, "
          f"inbox prefix {identity.inbox_prefix}")  # fmt: skip
    print(f"use it with: KVPAGER_NATS_IDENTITY={path} kvpager generate 'Hello'")
    if reloaded:
        print(f"reloaded the running embedded nats-server (pid {', '.join(map(str, reloaded))})")
    else:
        print("no embedded nats-server runs: the next `kvpager serve` accepts it")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from kvpager.services.schema import render

    sys.stdout.write(render())
    return 0


# vLLM's flags that mean nothing here: accepted, so a vLLM command line runs, with a warning
IGNORED_FLAGS = {
    "trust_remote_code": "kvpager runs its own code for the model families it knows",
    "disable_log_requests": "a request's log lines hold ids and counts, never its text "
    "(--log-level warning drops them)",
    "disable_log_stats": "kvpager logs no periodic stats (see kvpager stats, /metrics)",
    "disable_frontend_multiprocessing": "the gateway is always a process of its own",
}


def _add_ignored_flags(parser: argparse.ArgumentParser) -> None:
    for name, why in IGNORED_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, action="store_true", help=f"vLLM's; ignored here: {why}")


def _warn_ignored(args: argparse.Namespace) -> None:
    for name, why in IGNORED_FLAGS.items():
        if getattr(args, name, False):
            flag = "--" + name.replace("_", "-")
            print(f"kvpager: warning: {flag} is ignored: {why}", file=sys.stderr, flush=True)


def _take_positional_model(args: argparse.Namespace) -> None:
    """`kvpager serve MODEL`, as `vllm serve MODEL`: the same as --model."""
    if args.model_tag is None:
        return
    default = configured("model") or DEFAULT_MODEL
    if args.model not in (default, args.model_tag):  # --model given too, and another
        raise ConfigError(f"model: given twice ({args.model_tag!r} and --model {args.model!r})")
    args.model = args.model_tag


SERVICES = {
    "tokenizer": "validate and tokenize requests, stream text back",
    "scheduler": "plan steps and own the KV block accounting",
    "executor": "run the model on the paged KV cache",
}
HTTP_SERVICES = {
    "http": "OpenAI-compatible HTTP gateway onto a running kvpager, with /metrics (port 8000)",
    "metrics": "Prometheus /metrics of every instance, without the gateway (port 9090)",
}


def _add_service_parsers(sub) -> dict[str, Callable]:
    for name, help_text in SERVICES.items():
        add_arguments(sub.add_parser(name, help=f"NATS service: {help_text}"))
    serve = sub.add_parser(
        "serve",
        help="nats-server and the three services, ready to use",
        description="Without --nats-url, start a nats-server on loopback (--nats-port).",
    )
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the same as --model (vLLM's form)"
    )
    add_arguments(serve)
    _add_ignored_flags(serve)
    serve.set_defaults(nats_url=configured("nats_url"))  # unset: start an embedded server
    add_arguments(serve, ServeSettings)
    add_arguments(serve, HttpSettings)
    for name, help_text in HTTP_SERVICES.items():
        parser = sub.add_parser(name, help=help_text)
        add_arguments(parser)
        add_arguments(parser, HttpSettings)
    sub.add_parser("schema", help="print the JSON Schema of the public NATS API")
    creds = sub.add_parser(
        "credentials",
        help="NATS identities of the embedded server (under the cache dir)",
        description="add NAME: a client identity of its own (publishes the public subjects, "
        "receives on _INBOX_NAME.> only); running embedded servers reload their config.",
    )
    creds.add_argument("action", choices=["add"])
    creds.add_argument("name", help="letters, digits and '-'")
    add_arguments(creds, names=("prefix",))
    commands = {**dict.fromkeys(SERVICES, _cmd_service), **dict.fromkeys(HTTP_SERVICES, _cmd_http)}
    return {**commands, "serve": _cmd_serve, "schema": _cmd_schema, "credentials": _cmd_credentials}


def _add_client_parsers(sub) -> dict[str, Callable]:
    generate = sub.add_parser("generate", help="stream a completion from a running kvpager")
    _add_prompt_args(generate)
    stats = sub.add_parser("stats", help="KV cache, queue and latency figures (llm.stats)")
    stats.add_argument("--json", action="store_true", help="one JSON object")
    stats.add_argument("--watch", type=float, metavar="SECONDS", help="repeat until Ctrl-C")
    health = sub.add_parser("health", help="exit 0 if the API answers ok (llm.health)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    drain = sub.add_parser(
        "drain", help="move an instance's streams, KV blocks and all, to the other instances"
    )
    drain.add_argument("name", metavar="INSTANCE", help="the instance to drain")
    drain.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    for parser in (generate, stats, health, drain):
        add_arguments(parser, names=CONNECTION_FIELDS)
    commands = {"generate": _cmd_generate, "stats": _cmd_stats, "health": _cmd_health}
    return {**commands, "drain": _cmd_drain}


def _add_prompt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint folder or known model name (default: %(default)s)",
    )
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (the model's) | fp8 | fp8_e5m2 | ..."
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    parser.add_argument("--chat-template", default=None, help="a Jinja file or template for --chat")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of the device's memory (CPU: RAM) for weights plus KV cache",
    )
    _add_ignored_flags(parser)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable]]:
    parser = argparse.ArgumentParser(prog="kvpager", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    download = sub.add_parser("download", help="fetch and convert a known model")
    download.add_argument("model", nargs="?", help="default: $KVPAGER_MODEL, else the default")
    offline = sub.add_parser("offline", help="generate in-process, no NATS")
    _add_prompt_args(offline)
    _add_model_args(offline)
    commands = {"download": _cmd_download, "offline": _cmd_offline}
    commands.update(_add_service_parsers(sub))
    commands.update(_add_client_parsers(sub))
    commands.update(add_kv_size_parser(sub))
    commands.update(add_bench_parsers(sub))
    add_dynamo_parser(sub)
    commands["dynamo"] = run_dynamo
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    try:
        parser, commands = build_parser()  # flag defaults read KVPAGER_* variables
        args = parser.parse_args(argv)
        return commands[args.command](args)
    except (KvpagerError, ClientError) as exc:
        print(f"kvpager: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
