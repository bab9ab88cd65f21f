"""Structured outputs through the offline LLM on a tiny random model: whatever the random
weights prefer, every answer must match its grammar, and grammars that force an end end it."""

import json
import re

import pytest
from kvpager.engine import InvalidRequestError, SamplingParams, StructuredOutputsParams

from tests.engine.helpers import assert_all_free, make_llm

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}


def _check_schema(value: dict) -> None:
    assert set(value) == {"name", "size", "ok"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert value["size"] in ("small", "large") and isinstance(value["ok"], bool)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # plan-ahead and chunked prefill on, a small batch budget so 8 samples chunk their prompt
    llm = make_llm(tiny_llama, max_num_batched_tokens=16, plan_ahead=1)
    yield llm
    llm.close()


def _params(n: int = 1, **spec) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=1.0,
        seed=7,
        max_tokens=120,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def test_eight_samples_match_a_strict_schema(llm) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # longer than the budget
    [output] = llm.generate(prompt, _params(n=8, json=SCHEMA), use_tqdm=False)
    assert len(output.outputs) == 8
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample
        _check_schema(json.loads(sample.text))
    assert len({s.text for s in output.outputs}) > 1  # eight samples, not one copied
    assert_all_free(llm)


def test_choice_regex_and_json_object(llm) -> None:
    prompts = ["Once upon a time", "def add(a, b):", "Paged attention"]
    params = [
        _params(n=4, choice=["yes", "no", "maybe not"]),
        _params(regex=r"[0-9]{3}-[a-c]{2}"),
        SamplingParams(
            max_tokens=200,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
    ]
    choice, regex, obj = llm.generate(prompts, params, use_tqdm=False)
    assert {s.text for s in choice.outputs} <= {"yes", "no", "maybe not"}
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", regex.outputs[0].text), regex.outputs[0].text
    assert all(s.finish_reason == "stop" for s in choice.outputs + regex.outputs)
    if obj.outputs[0].finish_reason == "stop":  # a random model may fill 200 tokens first
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    else:
        assert obj.outputs[0].text.startswith("{")
    assert_all_free(llm)


def test_stop_string_inside_a_grammar(llm) -> None:
    params = SamplingParams(
        max_tokens=40,
        seed=1,
        stop=["b"],
        structured_outputs=StructuredOutputsParams(regex="a{3}b{3}"),
    )
    [output] = llm.generate("The quick", params, use_tqdm=False)
    assert output.outputs[0].text == "aaa" and output.outputs[0].stop_reason == "b"
    assert_all_free(llm)


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        ({"json": '{"type": "object", "properties": {"a": {"type": "intege"}}}'}, "json"),
        ({"json": "{not json"}, "json"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
    ],
)
def test_bad_spec_is_refused_naming_the_field(llm, spec: dict, param: str) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate("hello", params, use_tqdm=False)
    assert caught.value.param == f"structured_outputs.{param}"
    assert_all_free(llm)


def test_spec_rules() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a"))
    assert caught.value.param == "min_tokens"
    spec = StructuredOutputsParams(json={"type": "object"})
    assert spec.json == '{"type": "object"}' and spec.kind == "json"


def test_recomputed_requests_replay_their_grammar(tiny_llama) -> None:
    """Preempted by recompute, a request comes back to the executor with its outputs so far:
    its matcher is rebuilt and replays them, so the answer still matches."""
    llm = make_llm(tiny_llama, num_blocks=36, block_size=4, preemption_mode="recompute")
    try:
        prompts = ["The quick brown fox jumps over", "Paged attention stores keys"] * 3
        outputs = llm.generate(prompts, _params(json=SCHEMA), use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
        for output in outputs:
            _check_schema(json.loads(output.outputs[0].text))
        assert_all_free(llm)
    finally:
        llm.close()
