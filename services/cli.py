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
    return parser, {"download": _cmd_download, "offline": _cmd_offline}


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    try:
        return commands[args.command](args)
    except KvpagerError as exc:
        print(f"kvpager {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
