"""Bad input gets a typed error naming the field; nothing is allocated; the engine keeps working."""

import pytest
from kvpager.engine import ConfigError, InvalidRequestError, RequestTooLongError, SamplingParams
from kvpager.engine.config import host_memory_bytes

from tests.engine.helpers import assert_all_free, make_llm


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, max_model_len=64, max_num_seqs=8)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"top_k": "many"}, "top_k"),
        ({"n": 0}, "n"),
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 3, "temperature": 0.0, "top_p": 0.5}, "top_p"),
        ({"beam_width": 3, "temperature": 0.7}, "temperature"),
        ({"beam_width": 2, "n": 3, "temperature": 0.0}, "n"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_sampling_fields(llm, fields, param):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[5, 6, 7]], fields)
    assert error.value.param == param
    assert_all_free(llm)


@pytest.mark.parametrize(
    "prompt,params,param,error_type",
    [
        ("", SamplingParams(), "prompt", InvalidRequestError),
        ([], SamplingParams(), "prompt", InvalidRequestError),
        ([5, 999], SamplingParams(), "prompt", InvalidRequestError),
        ([5] * 70, SamplingParams(max_tokens=4), "prompt", RequestTooLongError),
        ([5] * 10, SamplingParams(max_tokens=60), "max_tokens", RequestTooLongError),
        ([5], SamplingParams(n=9), "n", InvalidRequestError),
        ([5], SamplingParams(beam_width=9, temperature=0.0), "beam_width", InvalidRequestError),
    ],
)
def test_invalid_prompts(llm, prompt, params, param, error_type):
    with pytest.raises(error_type) as error:
        llm.generate([[5, 6], prompt], params)  # the valid first prompt must not run either
    assert error.value.param == param
    assert llm.stats()["num_waiting"] == 0
    assert_all_free(llm)


def test_engine_keeps_working_after_errors(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7]], {"max_tokens": 0})
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4 or out.outputs[0].finish_reason == "stop"
    assert_all_free(llm)


def test_swap_space_beyond_host_memory(tiny_llama):
    with pytest.raises(ConfigError, match="swap_space"):
        make_llm(tiny_llama, swap_space=host_memory_bytes() * 2)


def test_cache_too_small_for_one_request(tiny_llama):
    llm = make_llm(tiny_llama, num_blocks=2)  # 16 token slots
    with pytest.raises(RequestTooLongError, match="whole KV cache"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=10))
    assert_all_free(llm)
