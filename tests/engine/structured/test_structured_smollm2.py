"""Structured outputs on the real default model, where an answer can end by itself: JSON
objects and a strict schema that parse, sampled and greedy."""

import json

import pytest
from kvpager.engine import SamplingParams
from kvpager.schemas.sampling import StructuredOutputsParams

from tests.engine.helpers import assert_all_free, make_llm

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}


def test_json_object_and_schema_answers_parse(smollm2_path):
    llm = make_llm(smollm2_path, block_size=16, num_blocks=256, attention_backend="cpu")
    ask = [{"role": "user", "content": "Describe Paris as a JSON object."}]
    obj = SamplingParams(
        temperature=0.0,
        max_tokens=128,
        structured_outputs=StructuredOutputsParams(json_object=True),
    )
    strict = SamplingParams(
        n=8,
        temperature=1.0,
        seed=7,
        max_tokens=128,
        structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)),
    )
    (greedy,), (sampled,) = llm.chat([ask], obj), llm.chat([ask], strict)
    assert greedy.outputs[0].finish_reason == "stop", greedy.outputs[0].text
    assert isinstance(json.loads(greedy.outputs[0].text), dict)
    for sample in sampled.outputs:
        assert sample.finish_reason == "stop", sample.text
        answer = json.loads(sample.text)
        assert set(answer) == set(SCHEMA["required"])
        assert isinstance(answer["is_capital"], bool)
        assert all(isinstance(answer[k], str) and len(answer[k]) <= 40 for k in ("city", "country"))
    assert_all_free(llm)
