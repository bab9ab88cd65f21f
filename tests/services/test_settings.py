"""Settings: flags over KVPAGER_* variables over defaults, checked once."""

import argparse

import pytest
from kvpager.schemas.errors import ConfigError
from kvpager.services.options import environment
from kvpager.services.settings import Settings, add_arguments


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


def test_disk_tier_settings_read_sizes(monkeypatch):
    from kvpager.engine.config import EngineConfig

    settings = _parse(["--kv-disk-dir", "/var/tmp/kv", "--kv-disk-bytes", "4GiB"])
    assert settings.kv_disk_bytes == 4 << 30 and settings.kv_disk_dir == "/var/tmp/kv"
    assert _parse_env(environment(settings)).kv_disk_bytes == 4 << 30
    monkeypatch.setenv("KVPAGER_KV_DISK_BYTES", "500MB")
    assert _parse([]).kv_disk_bytes == 500 * 10**6
    config = EngineConfig.pick(settings)
    assert (config.kv_disk_dir, config.kv_disk_bytes) == ("/var/tmp/kv", 4 << 30)
    assert type(config.kv_disk_bytes) is int  # msgpack-encodable, for tensor-parallel ranks
    assert _parse([]).kv_disk_dir is None  # off by default
    with pytest.raises(ConfigError, match="kv_disk_bytes"):
        EngineConfig(kv_disk_dir="/var/tmp/kv")
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(kv_disk_dir="/var/tmp/kv", kv_disk_bytes=1, tensor_parallel_size=2)
    monkeypatch.setenv("KVPAGER_KV_DISK_BYTES", "lots")
    with pytest.raises(ConfigError):
        _parse([])
