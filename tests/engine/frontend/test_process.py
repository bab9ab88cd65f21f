"""InputProcessor.process, a request's one trip down from either front door: which field gives
the prompt, the structured spec's sizes, the token ids, the caller's check, the compile check,
in that order (cheap refusals before costly work), each refusal naming its field."""

import asyncio

import pytest
from kvpager.engine.frontend.inputs import InputProcessor
from kvpager.engine.structured.limits import GrammarLimits
from kvpager.schemas.errors import InvalidRequestError, RequestTooLongError
from kvpager.schemas.sampling import SamplingParams, StructuredOutputsParams
from transformers import AutoTokenizer

from tests.models import VOCAB_SIZE

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
BAD_REGEX = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture
def inputs(tokenizer):
    processor = InputProcessor(tokenizer, VOCAB_SIZE)
    yield processor
    processor.close()


def _process(inputs: InputProcessor, params=GREEDY, **prompt):
    return asyncio.run(inputs.process(params, **prompt))


def test_each_prompt_field_gives_the_ids_its_own_call_gives(inputs, tokenizer):
    text = _process(inputs, prompt="Hello there", echo=True)
    assert text.token_ids == tokenizer.encode("Hello there") and text.param == "prompt"
    assert text.text == "Hello there"
    ids = _process(inputs, prompt_token_ids=[5, 6, 7], echo=True)
    assert ids.token_ids == [5, 6, 7] and ids.param == "prompt_token_ids"
    assert ids.text == tokenizer.decode([5, 6, 7], skip_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    chat = _process(inputs, messages=messages)
    assert chat.token_ids == inputs.chat_ids(messages) and chat.param == "messages"
    assert chat.text is None  # asked for with echo only


@pytest.mark.parametrize(
    "prompt, param",
    [
        ({}, "prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt_token_ids"),
        ({"prompt": "a", "tools": [{"type": "function"}]}, "tools"),
        ({"prompt_token_ids": [VOCAB_SIZE]}, "prompt_token_ids"),
        ({"prompt": [3, -1]}, "prompt"),  # offline, ids come as `prompt`
    ],
)
def test_bad_prompts_are_refused_naming_the_field(inputs, prompt, param):
    with pytest.raises(InvalidRequestError) as info:
        _process(inputs, **prompt)
    assert info.value.param == param


def test_the_check_sees_the_ids_and_refuses_before_the_compile(inputs):
    seen = []

    def too_long(token_ids: list[int], param: str) -> None:
        seen.append((list(token_ids), param))
        raise RequestTooLongError(f"{param}: too long", param=param)

    with pytest.raises(RequestTooLongError):  # not the bad regex's error: it never compiled
        _process(inputs, BAD_REGEX, prompt_token_ids=[4, 5], check=too_long)
    assert seen == [([4, 5], "prompt_token_ids")]
    with pytest.raises(InvalidRequestError, match="structured_outputs") as info:
        _process(inputs, BAD_REGEX, prompt_token_ids=[4, 5], check=lambda ids, param: None)
    assert not isinstance(info.value, RequestTooLongError)


def test_spec_sizes_are_refused_before_tokenizing(tokenizer):
    inputs = InputProcessor(tokenizer, VOCAB_SIZE, grammar_limits=GrammarLimits(max_bytes=4))
    long_regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a{1,3}b+"))
    checked = []
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        _process(inputs, long_regex, prompt_token_ids=[1], check=lambda *a: checked.append(a))
    assert not checked  # the size refusal came first
    inputs.close()
