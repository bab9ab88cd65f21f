"""`kvpager serve --speculative-config`: suffix decoding's JSON reaches the engine's config,
and a bad field is refused before any service starts."""

import json

import pytest
from kvpager.engine.config import EngineConfig
from kvpager.schemas.errors import ConfigError
from kvpager.services import cli
from kvpager.services.settings import Settings


def _settings(*argv: str) -> Settings:
    """The flags as `kvpager serve` reads them, into the settings every service builds."""
    parser, _ = cli.build_parser()
    args = parser.parse_args(["serve", "m", *argv])
    return Settings(speculative_config=args.speculative_config)


def test_suffix_config_from_the_command_line():
    flag = json.dumps(
        {"method": "suffix", "suffix_decoding_max_cached_requests": 64, "disable_by_batch_size": 4}
    )
    settings = _settings("--speculative-config", flag)
    config = EngineConfig(speculative_config=settings.speculative_config).speculative_config
    assert config.method == "suffix" and config.suffix_decoding_max_cached_requests == 64
    assert config.max_num_seqs_to_speculate == 4 and config.num_speculative_tokens == 24


def test_a_bad_suffix_field_is_refused_at_once():
    with pytest.raises(ConfigError, match="min_token_prob"):
        _settings(
            "--speculative-config", '{"method": "suffix", "suffix_decoding_min_token_prob": 2}'
        )
