"""Entry point of `kvpager dynamo`: its flags, then the worker (services/dynamo/worker.py).

Dynamo is an optional extra: without it, the command says how to install it.
"""

import argparse
import asyncio
import dataclasses

from kvpager.engine.config import EngineConfig
from kvpager.engine.download import resolve_model
from kvpager.engine.logs import configure_logging
from kvpager.schemas.errors import ConfigError
from kvpager.services.settings import Settings, add_arguments

DISAGGREGATION_MODES = ("prefill", "decode")


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "dynamo",
        help="serve the model as an NVIDIA Dynamo worker (pip install 'kvpager[dynamo]')",
        description="Register with Dynamo's runtime (discovery from DYN_DISCOVERY_BACKEND, "
        "DYN_FILE_KV or ETCD_ENDPOINTS) and serve tokens in, tokens out behind "
        "`python -m dynamo.frontend --router-mode kv`.",
    )
    add_arguments(parser, names=engine_flags())
    parser.add_argument("--namespace", default="dynamo", help="Dynamo namespace")
    parser.add_argument("--component", default="backend", help="Dynamo component")
    parser.add_argument("--endpoint", default="generate", help="Dynamo endpoint")
    parser.add_argument("--served-model-name", default=None, help="default: --model")
    parser.add_argument(
        "--disaggregation-mode",
        choices=DISAGGREGATION_MODES,
        default=None,
        help="prefill or decode worker of a disaggregated deployment: KV blocks move "
        "from prefill to decode over NIXL (pip install 'kvpager[nixl]')",
    )


def engine_flags() -> tuple[str, ...]:
    """The engine's settings (the same flags as `kvpager serve`), the model and logging."""
    settings = {f.name for f in dataclasses.fields(Settings)}
    engine = [f.name for f in dataclasses.fields(EngineConfig) if f.name in settings]
    return ("model", "log_level", "check_invariants", *engine)


def run(args: argparse.Namespace) -> int:
    try:
        from kvpager.services.dynamo.worker import DynamoOptions, serve
    except ImportError as exc:
        raise ConfigError(
            f"kvpager dynamo needs NVIDIA Dynamo ({exc}): pip install 'kvpager[dynamo]'"
        ) from exc
    configure_logging(args.log_level)
    settings = Settings.from_args(args)
    options = DynamoOptions(
        args.namespace,
        args.component,
        args.endpoint,
        args.served_model_name,
        args.disaggregation_mode,
    )
    path, config = resolve_model(settings.model), EngineConfig.pick(settings)
    asyncio.run(serve(path, settings.model, config, options, settings.check_invariants))
    return 0
