"""Dynamo's token-in request (its PreprocessedRequest, a plain dict) as a kvpager Request, and a
kvpager SampleDelta as Dynamo's output chunk.

Dynamo's frontend tokenizes, applies the chat template, detokenizes and matches stop strings
itself; the worker sees token ids, `sampling_options`, `stop_conditions` and
`output_options`, and streams back `{"token_ids", "index", "finish_reason"}` chunks. Nothing
from the wire is trusted: every field is checked here and a bad one is an InvalidRequestError.
"""

from typing import Any

from kvpager.engine.request import Request
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.sampling import SamplingParams, StructuredOutputsParams
from kvpager.schemas.tokenizer import SampleDelta

# Dynamo's sampling_options names that kvpager's SamplingParams takes as they are
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
GUIDED_FIELDS = ("json", "regex", "choice", "grammar")
# kvpager's finish reasons in Dynamo's words ("abort" is Dynamo's "cancelled")
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}


def to_request(
    payload: Any, request_id: str, eos_token_ids: tuple[int, ...], max_model_len: int
) -> Request:
    """The kvpager Request for one Dynamo request, or an InvalidRequestError."""
    if not isinstance(payload, dict):
        raise InvalidRequestError("request: must be an object", "request")
    token_ids = _token_ids(payload.get("token_ids"))
    stop = _section(payload, "stop_conditions")
    hidden = _int_list(stop.get("stop_token_ids_hidden"), "stop_token_ids_hidden")
    _refuse_logprobs(_section(payload, "output_options"))
    params = sampling_params(payload, len(token_ids), max_model_len)
    # the model's end tokens and Dynamo's hidden stop tokens both end a sample unseen
    eos = tuple(dict.fromkeys([*eos_token_ids, *hidden]))
    return Request(request_id, token_ids, params, eos, request_id=request_id)


def sampling_params(payload: dict, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    options, stop = _section(payload, "sampling_options"), _section(payload, "stop_conditions")
    fields = {name: options[name] for name in SAMPLING_FIELDS if options.get(name) is not None}
    max_tokens = stop.get("max_tokens")
    # none given: up to the model's length, as vLLM's worker does under Dynamo
    fields["max_tokens"] = max_model_len - num_prompt_tokens if max_tokens is None else max_tokens
    for name in ("min_tokens", "ignore_eos"):
        if stop.get(name) is not None:
            fields[name] = stop[name]
    if stop.get("stop_token_ids"):
        fields["stop_token_ids"] = _int_list(stop["stop_token_ids"], "stop_token_ids")
    params = SamplingParams.from_dict(fields)
    params.structured_outputs = _guided(options.get("guided_decoding"))
    return params


def to_output(delta: SampleDelta) -> dict[str, Any]:
    """One Dynamo output chunk; an error ends the stream as an exception (as Dynamo's workers
    raise), so the client sees an error, not a short completion."""
    if delta.finish_reason == "error":
        message = delta.error.message if delta.error else "the engine failed the request"
        raise RuntimeError(message)
    chunk: dict[str, Any] = {"token_ids": delta.token_ids, "index": delta.index}
    if delta.finish_reason is not None:
        chunk["finish_reason"] = FINISH_REASONS[delta.finish_reason]
        if isinstance(delta.stop_reason, int):  # a stop token id (not an end token)
            chunk["stop_reason"] = delta.stop_reason
    return chunk


def _section(payload: dict, name: str) -> dict:
    section = payload.get(name)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise InvalidRequestError(f"{name}: must be an object", name)
    return section


def _token_ids(value: Any) -> list[int]:
    token_ids = _int_list(value, "token_ids")
    if not token_ids:
        raise InvalidRequestError("token_ids: the prompt is empty", "token_ids")
    return token_ids


def _int_list(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise InvalidRequestError(f"{name}: must be a list of token ids", name)
    return value


def _guided(guided: Any) -> StructuredOutputsParams | None:
    if not guided:
        return None
    if not isinstance(guided, dict):
        raise InvalidRequestError("guided_decoding: must be an object", "guided_decoding")
    unknown = [k for k, v in guided.items() if v is not None and k not in GUIDED_FIELDS]
    if unknown:
        raise InvalidRequestError(f"guided_decoding: {unknown[0]} is not supported", unknown[0])
    return StructuredOutputsParams(**{k: v for k, v in guided.items() if v is not None})


def _refuse_logprobs(output: dict) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        if output.get(name) is not None:
            raise InvalidRequestError(f"{name}: not served through the Dynamo worker yet", name)
