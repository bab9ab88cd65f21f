"""What a chat template may not know (engine/frontend/chat_fallbacks.py), on the tiny model's
ChatML template, which ignores `tools` as SmolLM2's does: developer turns become system ones,
tools go into the system turn, and a template that knows tools is left alone."""

import asyncio
import json

import pytest
from kvpager.engine.frontend.chat_fallbacks import TOOLS_HEADER
from kvpager.engine.frontend.inputs import InputProcessor
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.sampling import SamplingParams
from transformers import AutoTokenizer

from tests.models import VOCAB_SIZE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS_TEMPLATE = (  # a template that renders tools, as Qwen's and Hermes' do
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _text(inputs: InputProcessor, messages, tools=None) -> str:
    ids = inputs.chat_ids(messages, tools=tools)
    return inputs.tokenizer.decode(ids, skip_special_tokens=False)


def test_developer_is_system_where_the_template_has_no_developer_turn(tokenizer):
    inputs = InputProcessor(tokenizer, VOCAB_SIZE)
    user = {"role": "user", "content": "Hi"}
    developer = _text(inputs, [{"role": "developer", "content": "Be brief."}, user])
    system = _text(inputs, [{"role": "system", "content": "Be brief."}, user])
    assert developer == system and "<|im_start|>system\nBe brief." in system
    tokenizer.chat_template = tokenizer.chat_template + "{# developer #}"
    kept = _text(InputProcessor(tokenizer, VOCAB_SIZE), [{"role": "developer", "content": "x"}])
    assert "<|im_start|>developer" in kept


def test_tools_go_into_the_system_turn_of_a_template_that_ignores_them(tokenizer):
    inputs = InputProcessor(tokenizer, VOCAB_SIZE)
    assert not inputs.renders_tools
    user = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = _text(inputs, user)
    with_tools = _text(inputs, user, tools=[WEATHER])
    assert with_tools != plain and with_tools.endswith(plain)
    assert with_tools.startswith("<|im_start|>system\n" + TOOLS_HEADER)
    assert json.dumps(WEATHER) in with_tools and "<tool_call>" in with_tools
    system = [{"role": "system", "content": "Be brief."}, *user]
    merged = _text(inputs, system, tools=[WEATHER])
    assert merged.startswith("<|im_start|>system\nBe brief.\n\n" + TOOLS_HEADER)
    assert merged.count("<|im_start|>system") == 1


def test_a_template_that_renders_tools_is_left_alone(tokenizer):
    tokenizer.chat_template = TOOLS_TEMPLATE
    inputs = InputProcessor(tokenizer, VOCAB_SIZE)
    assert inputs.renders_tools
    text = _text(inputs, [{"role": "user", "content": "Hi"}], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nTOOLS ") and TOOLS_HEADER not in text


def test_logit_bias_ids_are_checked_against_the_vocabulary(tokenizer):
    inputs = InputProcessor(tokenizer, VOCAB_SIZE)
    params = SamplingParams(logit_bias={VOCAB_SIZE: 1.0})
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(inputs.process(params, prompt="Hi"))
    assert caught.value.param == "logit_bias" and str(VOCAB_SIZE) in str(caught.value)
    done = asyncio.run(
        inputs.process(SamplingParams(logit_bias={VOCAB_SIZE - 1: 1.0}), prompt="Hi")
    )
    assert done.token_ids


@pytest.mark.slow
def test_smollm2s_template_drops_tools_and_gets_them_in_the_system_turn(smollm2_path):
    """The issue's case: SmolLM2-135M-Instruct's template ignores `tools`."""
    smollm2 = AutoTokenizer.from_pretrained(smollm2_path)
    inputs = InputProcessor(smollm2, smollm2.vocab_size)
    assert not inputs.renders_tools
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = _text(inputs, messages, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + TOOLS_HEADER)
    assert '"name": "get_weather"' in text
