"""Whether a request can ever run under the engine's limits (raised as typed errors)."""

from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.kv.kv_groups import max_blocks_per_seq
from kvpager.engine.request import Request
from kvpager.schemas.errors import InvalidRequestError, RequestTooLongError

MAX_PIN_TTL = 86400.0  # seconds: PromptCache.ttl's bound


def check_request_fits(
    request: Request, config: SchedulerConfig, cache_config: CacheConfig
) -> None:
    """Raise a typed error if the request can never run: too many sequences, too long.

    Prompts were checked by the input path (engine/frontend/inputs.py) before they became
    Requests; their ids are checked against the vocabulary again here, off the wire."""
    if not request.prompt_token_ids:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    params = request.sampling_params
    _check_token_ids(request, config.vocab_size)
    _check_pin(request)
    for name in ("n", "beam_width"):
        if getattr(params, name) > config.max_num_seqs:
            raise InvalidRequestError(
                f"{name}: {getattr(params, name)} sequences exceed max_num_seqs "
                f"({config.max_num_seqs})",
                param=name,
            )
    max_len, block_size = config.max_model_len, cache_config.block_size
    if request.max_num_tokens > max_len:
        raise RequestTooLongError(
            f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
            f"({request.sampling_params.max_tokens}) exceeds max_model_len ({max_len})",
            param="max_tokens" if request.num_prompt_tokens < max_len else "prompt",
        )
    # a chunk takes at most the step's budget (the threshold spares forking parents)
    max_chunk = min(config.max_num_batched_tokens, request.max_num_tokens)
    peak = max_blocks_per_seq(
        cache_config.group_windows, request.max_num_tokens, block_size, max_chunk
    )
    if peak > cache_config.num_blocks:
        raise RequestTooLongError(
            f"prompt + max_tokens ({request.max_num_tokens} tokens) exceeds the whole KV "
            f"cache ({cache_config.num_slots} token slots)"
            + _groups_note(cache_config.group_windows, peak, cache_config.num_blocks),
            param="max_tokens",
        )


def _check_token_ids(request: Request, vocab_size: int) -> None:
    """Prompt ids inside the vocabulary: the executor would refuse the whole step holding one,
    and with it every request beside it. (Stop token ids outside it simply never match.)"""
    ids = request.prompt_token_ids
    if vocab_size and not (0 <= min(ids) and max(ids) < vocab_size):
        raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab_size})", param="prompt")


def _check_pin(request: Request) -> None:
    """A pinned prefix (resolved by the input path, or off the wire) inside the prompt, for a
    TTL the public schema allows."""
    if not 0 <= request.pin_tokens <= request.num_prompt_tokens:
        raise InvalidRequestError(
            f"cache.prefix_tokens: {request.pin_tokens} is not within the prompt's "
            f"{request.num_prompt_tokens} tokens",
            param="cache",
        )
    if request.pin_tokens and not 0.0 < request.pin_ttl <= MAX_PIN_TTL:
        raise InvalidRequestError(f"cache.ttl: must be in (0, {MAX_PIN_TTL:g}]", param="cache")


def _groups_note(windows: tuple[int, ...], peak: int, num_blocks: int) -> str:
    if len(windows) <= 1 and not any(windows):
        return ""
    return f": it needs {peak} blocks at its peak over its KV groups, the cache has {num_blocks}"
