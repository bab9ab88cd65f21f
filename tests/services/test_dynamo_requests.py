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


def _held(num_prompt_tokens: int = 3, agent: str = "peer") -> dict:
    from kvpager.schemas.kv_transfer import KvAgent, KvHandoff

    card = KvAgent(agent, "i", "nixl", b"md", "DRAM", 0, 4096, 8, 64, 512, "f32", 16, "t")
    handoff = KvHandoff("t1", "i", agent, [[4]], 3)
    return {"agent": card, "handoff": handoff, "num_prompt_tokens": num_prompt_tokens}


def test_disaggregated_params_round_trip_and_bad_ones_are_refused():
    import msgspec
    from kvpager.schemas.kv_transfer import KvHandoff
    from kvpager.services.dynamo.disagg import all_but_last, parse_params

    request = to_request(payload(), "r", EOS, 64)
    wire = msgspec.json.decode(msgspec.json.encode(msgspec.to_builtins(_held())))  # JSON-safe
    card, handoff = parse_params(wire, request)
    assert card.metadata == b"md" and handoff.block_tables == [[4]]
    for bad, match in (
        (_held(num_prompt_tokens=4), "another prompt"),
        ({**_held(), "handoff": KvHandoff("t1", "i", "other", [[4]], 3)}, "does not match"),
        ({**_held(), "agent": "card"}, "Expected"),
    ):
        with pytest.raises((ValueError, msgspec.ValidationError), match=match):
            parse_params(msgspec.to_builtins(bad), request)
    with pytest.raises(TypeError):
        parse_params([1], request)
    # the decode side reads all but the last prompt token's K/V; a one-token prompt recomputes
    assert all_but_last(KvHandoff("t", "i", "a", [[4, 5]], 17), 16).block_tables == [[4]]
    assert all_but_last(KvHandoff("t", "i", "a", [[4]], 1), 16) is None


def test_cli_says_how_to_install_dynamo(monkeypatch, capsys):
    from kvpager.services.cli import main

    monkeypatch.setitem(sys.modules, "kvpager.services.dynamo.worker", None)  # as if absent
    assert main(["dynamo", "--model", "x"]) == 2
    assert "pip install 'kvpager[dynamo]'" in capsys.readouterr().err
