"""The admission caps that bound what cannot be cut on the wire: each is a typed error naming
its field and its limit, and a beam row asks the executor for no more candidates than the
selection can use."""

import pytest
from kvpager.engine.sched.beam_search import num_candidates
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.public import GenerateRequest
from kvpager.schemas.sampling import SamplingParams, StructuredOutputsParams
from kvpager.services.tokenizer.limits import RequestLimits

LIMITS = RequestLimits()


def test_stop_token_ids_are_counted():
    LIMITS.check_fields(GenerateRequest(prompt="x", stop_token_ids=list(range(256))))
    with pytest.raises(InvalidRequestError, match=r"3152 stop token ids .* limit \(256\)") as exc:
        LIMITS.check_fields(GenerateRequest(prompt="x", stop_token_ids=list(range(3152))))
    assert exc.value.param == "stop_token_ids"


def test_a_beam_row_needs_width_plus_its_distinct_stop_ids():
    params = SamplingParams(beam_width=16, temperature=0.0, stop_token_ids=[5, 6, 6, 7])
    assert num_candidates(params, eos_ids=[2, 7]) == 16 + 4  # {2, 5, 6, 7}
    # the 3,152 stop ids of the probe asked 50,464 per row: the whole vocabulary
    wide = SamplingParams(beam_width=16, temperature=0.0, stop_token_ids=list(range(1100)))
    limits = RequestLimits(max_stop_token_ids=4096)
    with pytest.raises(InvalidRequestError, match=r"1116 beam candidates .* limit \(1024\)"):
        limits.check_params(wide)
    limits.check_params(SamplingParams(beam_width=16, temperature=0.0, stop_token_ids=[1] * 9))


def test_prompt_logprob_values_are_bounded():
    params = SamplingParams(prompt_logprobs=20)
    LIMITS.check_prompt_logprobs(params, 12_000)  # 252,000
    with pytest.raises(InvalidRequestError, match=r"273000 prompt logprob values") as exc:
        LIMITS.check_prompt_logprobs(params, 13_000)
    assert exc.value.param == "prompt_logprobs"
    LIMITS.check_prompt_logprobs(SamplingParams(), 10**9)  # none asked


def test_sampling_params_bytes_are_bounded():
    limits = RequestLimits(max_sampling_params_bytes=8192)
    limits.check_params(SamplingParams(structured_outputs=StructuredOutputsParams(json="{}")))
    big = StructuredOutputsParams(json='{"description": "%s"}' % ("x" * 9000))
    with pytest.raises(InvalidRequestError, match=r"bytes of sampling parameters") as exc:
        limits.check_params(SamplingParams(structured_outputs=big))
    assert exc.value.param == "structured_outputs"
