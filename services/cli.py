"""The `kvpager` command: one subcommand per job, each a thin call into engine or services."""

import argparse
import sys
from collections.abc import Callable

from engine.errors import KvpagerError

DEFAULT_MODEL = "smollm2-135m-instruct"


def _cmd_download(args: argparse.Namespace) -> int:
    from engine.download import resolve_model

    print(resolve_model(args.model, progress=True))
    return 0


def _cmd_offline(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
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
    from services.settings import Settings

    settings = Settings.from_args(args)
    if args.command == "tokenizer":
        from services.tokenizer.main import run
    elif args.command == "scheduler":
        from services.scheduler.main import run
    else:
        from services.executor.main import run
    return run(settings)


def _cmd_schema(args: argparse.Namespace) -> int:
    from services.schema import render

    sys.stdout.write(render())
    return 0


SERVICES = {
    "tokenizer": "validate and tokenize requests, stream text back",
    "scheduler": "plan steps and own the KV block accounting",
    "executor": "run the model on the paged KV cache",
}


def _add_service_parsers(sub) -> dict[str, Callable]:
    from services.settings import add_arguments

    for name, help_text in SERVICES.items():
        add_arguments(sub.add_parser(name, help=f"NATS service: {help_text}"))
    sub.add_parser("schema", help="print the JSON Schema of the public NATS API")
    return {**dict.fromkeys(SERVICES, _cmd_service), "schema": _cmd_schema}


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint folder or known model name (default: %(default)s)",
    )
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    parser.add_argument("--max-model-len", type=int, default=None)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable]]:
    parser = argparse.ArgumentParser(prog="kvpager", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    download = sub.add_parser("download", help="fetch and convert a known model")
    download.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    offline = sub.add_parser("offline", help="generate in-process, no NATS")
    offline.add_argument("prompt")
    offline.add_argument("--chat", action="store_true", help="apply the chat template")
    offline.add_argument("--max-tokens", type=int, default=64)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--seed", type=int, default=None)
    _add_model_args(offline)
    commands = {"download": _cmd_download, "offline": _cmd_offline}
    commands.update(_add_service_parsers(sub))
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    try:
        parser, commands = build_parser()  # flag defaults read KVPAGER_* variables
        args = parser.parse_args(argv)
        return commands[args.command](args)
    except KvpagerError as exc:
        print(f"kvpager: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
