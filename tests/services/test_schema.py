"""The public schema: checked in, in sync, and faithful to the engine's SamplingParams."""

import subprocess
from pathlib import Path

import msgspec
from kvpager.schemas.public import GenerateEvent, GenerateRequest
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.schema import render
from kvpager.services.serve.processes import python_module

SCHEMA_FILE = Path(__file__).parents[2] / "schemas" / "public.schema.json"


def test_checked_in_schema_is_in_sync():
    assert SCHEMA_FILE.read_text() == render(), "run: kvpager schema > schemas/public.schema.json"


def test_kvpager_schema_prints_it():
    out = subprocess.run(
        python_module("kvpager.services.cli", "schema"),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out == SCHEMA_FILE.read_text()


def test_sampling_fields_match_sampling_params():
    engine, public = SamplingParams(), GenerateRequest()
    for name in SamplingParams.__struct_fields__:
        assert name in GenerateRequest.__struct_fields__, f"GenerateRequest lacks {name!r}"
        assert getattr(public, name) == getattr(engine, name), name


def test_final_event_is_the_one_with_usage():
    event = msgspec.json.decode(b'{"request_id": "r", "seq": 0}', type=GenerateEvent)
    assert not event.is_final and event.finish_reason is None
