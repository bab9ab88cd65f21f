"""The size checks on a structured-outputs spec: each attack refused in milliseconds, naming
its limit, while realistic specs (a nested Pydantic model through $defs, an OpenAI tool
schema, recursive schemas) pass."""

import json
import time
from typing import Literal

import pydantic
import pytest
from kvpager.engine.frontend.tool_calls import required_schema
from kvpager.engine.structured.limits import DEFAULT_LIMITS, GrammarLimits, check_spec
from kvpager.engine.structured.regex_limits import max_repeat
from kvpager.schemas.errors import ConfigError, InvalidRequestError
from kvpager.schemas.sampling import StructuredOutputsParams

N = 3000


def lark_chain(n: int = N) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} "a"' for i in range(n)) + f'\nr{n}: "b"'


def gbnf_chain(n: int = N) -> str:
    rules = "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(n))
    return f'root ::= r0\n{rules}\nr{n} ::= "b"'


def ref_chain(n: int = N) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def patterns_schema(n: int = 40) -> dict:
    """An allOf of `n` patterns (~1.5 KB at 40): intersecting them floods the compiler."""
    return {"type": "string", "allOf": [{"pattern": f"^(.*[a-z]{{{i % 7 + 1}}}.*)+$"}
                                        for i in range(n)]}  # fmt: skip


def refused(spec: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as caught:
        check_spec(spec, limits)
    assert time.perf_counter() - started < 0.5  # a walk, never a compile
    assert caught.value.param == f"structured_outputs.{spec.kind}"
    return str(caught.value)


@pytest.mark.parametrize(
    ("spec", "flag"),
    [
        (StructuredOutputsParams(grammar=lark_chain()), "--grammar-max-rules"),
        (StructuredOutputsParams(grammar=gbnf_chain()), "--grammar-max-rules"),
        (StructuredOutputsParams(json=json.dumps(ref_chain())), "--grammar-max-bytes"),
        (StructuredOutputsParams(json=json.dumps(ref_chain(500))), "--grammar-max-depth"),
        (StructuredOutputsParams(json=json.dumps(patterns_schema())), "--grammar-max-patterns"),
        (StructuredOutputsParams(regex="a{1000}{1000}"), "--grammar-max-repeat"),
        (StructuredOutputsParams(regex="(ab{200}){200}"), "--grammar-max-repeat"),
        (StructuredOutputsParams(regex="x{100000}"), "--grammar-max-repeat"),
        (StructuredOutputsParams(grammar='start: "a" ~ 100000'), "--grammar-max-repeat"),
        (StructuredOutputsParams(grammar="root ::= [a]{0,99999}"), "--grammar-max-repeat"),
        (StructuredOutputsParams(choice=[str(i) for i in range(1001)]), "--grammar-max-alt"),
        (StructuredOutputsParams(regex="a" * 70000), "--grammar-max-bytes"),
    ],
)
def test_each_attack_is_refused_naming_its_limit(spec, flag):
    assert flag in refused(spec)


def test_a_ref_chain_is_refused_by_each_of_its_limits():
    text = json.dumps(ref_chain())
    roomy = GrammarLimits(max_bytes=1 << 20)
    assert "--grammar-max-rules" in refused(StructuredOutputsParams(json=text), roomy)
    roomy = GrammarLimits(max_bytes=1 << 20, max_rules=10000)
    assert "--grammar-max-depth" in refused(StructuredOutputsParams(json=text), roomy)


def test_a_schema_nested_past_the_depth_is_refused_even_past_pythons_recursion():
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    assert "--grammar-max-depth" in refused(StructuredOutputsParams(json=json.dumps(deep)))
    text = '{"items":' * 5000 + "{}" + "}" * 5000  # json.loads itself would recurse too far
    assert "--grammar-max-depth" in refused(StructuredOutputsParams(json=text))


@pytest.mark.parametrize("value", [1 << 64, -(1 << 63) - 1, 10**30])
def test_an_integer_beyond_64_bits_is_refused(value):
    schema = {"type": "integer", "maximum": value}
    assert "64 bits" in refused(StructuredOutputsParams(json=json.dumps(schema)))


def test_one_wide_anyof_is_refused():
    schema = {"anyOf": [{"const": i} for i in range(1001)]}
    assert "anyOf" in refused(StructuredOutputsParams(json=json.dumps(schema)))


def test_ref_diamonds_cost_one_visit_each():
    """d_i refers to d_{i+1} twice: 2**60 paths, one visit per definition."""
    defs = {f"d{i}": {"type": "object", "properties": {
        "a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(60)}  # fmt: skip
    defs["d60"] = {"type": "integer"}
    schema = {"$ref": "#/$defs/d0", "$defs": defs}
    assert "--grammar-max-depth" in refused(StructuredOutputsParams(json=json.dumps(schema)))
    wide = GrammarLimits(max_depth=400)
    started = time.perf_counter()
    check_spec(StructuredOutputsParams(json=json.dumps(schema)), wide)
    assert time.perf_counter() - started < 0.5


class Address(pydantic.BaseModel):
    street: str
    city: str
    zip_code: str = pydantic.Field(pattern=r"^\d{5}(-\d{4})?$")


class Person(pydantic.BaseModel):
    name: str
    home: Address
    work: Address | None = None
    tags: list[Literal["a", "b", "c"]] = []


class Team(pydantic.BaseModel):
    lead: Person
    members: list[Person]
    sub_teams: list["Team"] = []  # recursive: legitimate, bounded by the compiler


def test_realistic_schemas_pass():
    team = Team.model_json_schema()
    assert "$defs" in team
    tool = {"name": "plan", "parameters": team}
    for schema in (team, required_schema([tool, {"name": "clock"}])):
        check_spec(StructuredOutputsParams(json=json.dumps(schema)), DEFAULT_LIMITS)
    check_spec(StructuredOutputsParams(regex=r"\d{3}-\d{4}|[a-f]{2}-[0-9]{3}"), DEFAULT_LIMITS)
    check_spec(StructuredOutputsParams(grammar=lark_chain(200)), DEFAULT_LIMITS)
    check_spec(StructuredOutputsParams(choice=["red", "green"]), DEFAULT_LIMITS)


def test_nested_repetition_multiplies():
    assert max_repeat("a{1000}{1000}") == 10**6
    assert max_repeat("(a{10})(b{20}){2}") == 40
    assert max_repeat(r"\d{3}-\d{4}") == 4
    assert max_repeat("[{]{9}") == 9  # a class holding a brace is one atom
    assert max_repeat("x{3,}|y{5,7}") == 7
    assert max_repeat("abc") == 1


def test_limits_are_checked():
    with pytest.raises(ConfigError, match="grammar_max_rules"):
        GrammarLimits(max_rules=0)
    with pytest.raises(ConfigError, match="grammar_compile_memory"):
        GrammarLimits(compile_memory=1 << 20)
