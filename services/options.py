"""How a settings dataclass becomes flags and `KVPAGER_*` variables: `option` declares a field
(its help and marks), `add_arguments` makes its flags with defaults read from the environment
(the one place that reads it), `environment` writes the variables a child process reads back."""

import argparse
import dataclasses
import os
import types
from dataclasses import field
from typing import Any, Union, get_args, get_origin, get_type_hints

from kvpager.engine.kv.kv_size import parse_bytes
from kvpager.schemas.errors import ConfigError

ENV_PREFIX = "KVPAGER_"


class ByteSize(int):
    """A byte count that also reads sizes such as 4GiB or 500MB (flags and environment)."""

    def __new__(cls, value: "int | str") -> "ByteSize":
        return super().__new__(cls, parse_bytes(value) if isinstance(value, str) else value)


def option(help_text: str, **extra: Any) -> Any:
    """A settings field: its flag's help, its default, and `secret` / `repeated` marks, and
    `aliases`: more flags for it (vLLM's names)."""
    return field(default=extra.pop("default"), metadata={"help": help_text, **extra})


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None
) -> None:
    """One flag per setting of `cls` (only `names` if given); defaults from `KVPAGER_<NAME>`."""
    hints = get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        if names is not None and spec.name not in names:
            continue
        kind = base_type(hints[spec.name])
        flag = "--" + spec.name.replace("_", "-")
        env_name = ENV_PREFIX + spec.name.upper()
        default = from_env(env_name, kind, spec.default)
        shown = "(set)" if spec.metadata.get("secret") and default is not None else default
        help_text = f"{spec.metadata['help']} [env {env_name}; default {shown}]"
        flags = (flag, *spec.metadata.get("aliases", ()))
        if spec.metadata.get("repeated"):  # each flag adds one; from_args joins them with ","
            first = None if default is None else [default]
            parser.add_argument(*flags, action="append", default=first, help=help_text)
        elif kind is bool:
            parser.add_argument(
                *flags, default=default, help=help_text, action=argparse.BooleanOptionalAction
            )
        else:
            parser.add_argument(*flags, type=kind, default=default, help=help_text)


def environment(settings: Any) -> dict[str, str]:
    """The `KVPAGER_*` variables that reproduce `settings` (a Settings, ServeSettings or
    services.http.settings.HttpSettings) in a child process (launchers)."""
    env = {}
    for spec in dataclasses.fields(settings):
        value = getattr(settings, spec.name)
        if value is not None:
            env[ENV_PREFIX + spec.name.upper()] = (
                str(value).lower() if isinstance(value, bool) else str(value)
            )
    return env


def base_type(hint: Any) -> type:
    if get_origin(hint) in (Union, types.UnionType):
        return next(arg for arg in get_args(hint) if arg is not type(None))
    return hint


def from_env(name: str, kind: type, default: Any) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if kind is bool:
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ConfigError(f"{name}: {raw!r} is not a boolean")
        return raw.lower() in ("1", "true", "yes", "on")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}: {raw!r} is not a valid {kind.__name__}") from exc
