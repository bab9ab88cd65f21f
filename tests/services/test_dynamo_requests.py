"""Dynamo's token-in requests as kvpager Requests (services/dynamo/requests.py): what maps, and
what is refused with a typed error. Needs no Dynamo: the mapping is plain dicts."""

import sys

import pytest
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.tokenizer import SampleDelta
from kvpager.services.dynamo.requests import to_output, to_request

EOS = (2,)


def payload(**sections) -> dict:
    return {"token_ids": [5, 6, 7], **sections}


def test_fields_map_to_sampling_params():
    request = to_request(
        payload(
            sampling_options={"temperature": 0.5, "top_k": 4, "seed": 9, "n": 2},
            stop_conditions={
                "max_tokens": 12,
                "min_tokens": 3,
                "ignore_eos": True,
                "stop_token_ids": [11],
                "stop_token_ids_hidden": [3, 2],
            },
        ),
        "r1",
        EOS,
        max_model_len=64,
    )
    params = request.sampling_params
    assert (params.temperature, params.top_k, params.seed, params.n) == (0.5, 4, 9, 2)
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (12, 3, True)
    assert params.stop_token_ids == [11]
    assert request.eos_token_ids == (2, 3)  # the model's and Dynamo's hidden stop tokens
    assert request.prompt_token_ids == [5, 6, 7] and request.request_id == "r1"


def test_max_tokens_defaults_to_the_rest_of_the_model_length():
    request = to_request(payload(), "r", EOS, max_model_len=64)
    assert request.sampling_params.max_tokens == 64 - 3


def test_guided_decoding_maps_to_structured_outputs():
    guided = {"regex": "[ab]+", "json": None}
    request = to_request(payload(sampling_options={"guided_decoding": guided}), "r", EOS, 64)
    assert request.sampling_params.structured_outputs.regex == "[ab]+"


@pytest.mark.parametrize(
    "bad, param",
    [
        ([1, 2], "request"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -1]}, "token_ids"),
        ({"token_ids": [1, True]}, "token_ids"),
        ({"token_ids": "abc"}, "token_ids"),
        (payload(sampling_options=[]), "sampling_options"),
        (payload(sampling_options={"temperature": -1.0}), "temperature"),
        (payload(sampling_options={"temperature": "hot"}), None),
        (payload(stop_conditions={"stop_token_ids_hidden": ["x"]}), "stop_token_ids_hidden"),
        (payload(output_options={"logprobs": 2}), "logprobs"),
        (payload(sampling_options={"guided_decoding": {"structural_tag": "x"}}), "structural_tag"),
    ],
)
def test_bad_requests_are_refused_with_a_typed_error(bad, param):
    with pytest.raises(InvalidRequestError) as error:
        to_request(bad, "r", EOS, max_model_len=64)
    if param is not None:
        assert error.value.param == param


def test_outputs_in_dynamo_words():
    assert to_output(SampleDelta("r", 0, [4, 5])) == {"token_ids": [4, 5], "index": 0}
    final = to_output(SampleDelta("r", 1, [], finish_reason="abort"))
    assert final == {"token_ids": [], "index": 1, "finish_reason": "cancelled"}
    stopped = to_output(SampleDelta("r", 0, [9], finish_reason="stop", stop_reason=9))
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == 9
    with pytest.raises(RuntimeError, match="boom"):
        from kvpager.schemas.public import ErrorInfo

        to_output(SampleDelta("r", 0, [], finish_reason="error", error=ErrorInfo("x", "boom")))


def test_cli_refuses_disaggregation_until_built(capsys):
    from kvpager.services.cli import main

    assert main(["dynamo", "--model", "x", "--disaggregation-mode", "prefill"]) == 2
    assert "--disaggregation-mode: not built yet" in capsys.readouterr().err


def test_cli_says_how_to_install_dynamo(monkeypatch, capsys):
    from kvpager.services.cli import main

    monkeypatch.setitem(sys.modules, "kvpager.services.dynamo.worker", None)  # as if absent
    assert main(["dynamo", "--model", "x"]) == 2
    assert "pip install 'kvpager[dynamo]'" in capsys.readouterr().err
