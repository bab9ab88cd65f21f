"""compose.disagg.yaml is compose.yaml with its one scheduler + executor pair replaced by a
prefill pair and a decode pair (tests/services/test_compose.py runs compose.yaml's commands;
these are the same commands, with KVPAGER_INSTANCE and KVPAGER_ROLE)."""

from pathlib import Path

import yaml
from kvpager.services.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PLAIN = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
DISAGG = yaml.safe_load((ROOT / "compose.disagg.yaml").read_text())["services"]
ROLE_KEYS = {"KVPAGER_INSTANCE", "KVPAGER_ROLE"}


def test_a_prefill_and_a_decode_pair_with_compose_yaml_commands():
    assert set(DISAGG) == set(PLAIN) - {"scheduler", "executor"} | {
        f"{kind}-{role}" for kind in ("scheduler", "executor") for role in ("prefill", "decode")
    }
    for name in set(PLAIN) - {"scheduler", "executor"}:
        assert DISAGG[name] == PLAIN[name], name
    for kind in ("scheduler", "executor"):
        plain_env = PLAIN[kind].get("environment", DISAGG["tokenizer"]["environment"])
        for role in ("prefill", "decode"):
            service = DISAGG[f"{kind}-{role}"]
            assert service["command"] == PLAIN[kind]["command"]
            env = service["environment"]
            assert {k: v for k, v in env.items() if k not in ROLE_KEYS} == plain_env
            assert env["KVPAGER_ROLE"] == role and env["KVPAGER_INSTANCE"] == f"{role}-0"
            Settings(role=env["KVPAGER_ROLE"], instance=env["KVPAGER_INSTANCE"])  # valid
