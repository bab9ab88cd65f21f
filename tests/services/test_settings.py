"""Settings: flags over KVPAGER_* variables over defaults, checked once."""

import argparse

import pytest

from schemas.errors import ConfigError
from services.settings import Settings, add_arguments, environment


def _parse(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return Settings.from_args(parser.parse_args(argv))


def test_flags_override_environment_over_defaults(monkeypatch):
    monkeypatch.setenv("KVPAGER_INSTANCE", "blue")
    monkeypatch.setenv("KVPAGER_NUM_BLOCKS", "64")
    monkeypatch.setenv("KVPAGER_ENABLE_PREFIX_CACHING", "false")
    settings = _parse(["--num-blocks", "32"])
    assert settings.instance == "blue" and settings.num_blocks == 32
    assert settings.enable_prefix_caching is False and settings.block_size == 16


def test_environment_round_trips():
    settings = Settings(instance="green", num_blocks=10, check_invariants=True)
    assert _parse_env(environment(settings)) == settings


def _parse_env(env: dict[str, str]) -> Settings:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return _parse([])


@pytest.mark.parametrize(
    "env, value", [("KVPAGER_NUM_BLOCKS", "many"), ("KVPAGER_CHECK_INVARIANTS", "perhaps")]
)
def test_bad_environment_values_raise(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError):
        _parse([])


@pytest.mark.parametrize(
    "fields",
    [
        {"instance": "a.b"},
        {"prefix": "llm.*"},
        {"piece_tokens": 0},
        {"step_timeout": 0},
        {"kv_cache_dtype": "fp4"},
    ],
)
def test_invalid_settings_raise(fields):
    with pytest.raises(ConfigError):
        Settings(**fields)
