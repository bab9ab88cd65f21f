"""Which waiting prompt may start its prefill now: vLLM's partial-prefill limits and a block
reservation, so prompts that arrive together finish one after another instead of all at once,
and a prompt is not started when finishing it would preempt the requests already running.

Pure queries over the running requests and the block manager; admission.py asks them.
"""

import enum

from kvpager.engine.config import SchedulerConfig
from kvpager.engine.request import Request


class PrefillSlot(enum.Enum):
    FREE = "free"
    # either way a prompt finishing in its first chunk may start in its place
    FULL = "full"  # max_num_partial_prefills prompts are prefilling
    LONG_HELD = "long_held"  # max_long_partial_prefills long prompts are


def remaining_prefill(request: Request) -> int:
    """Tokens still to compute before the request samples (its prompt, or after a
    recompute its prompt and outputs); 0 once it decodes."""
    return max(0, request.num_tokens - 1 - request.num_computed_tokens)


def is_long(num_tokens: int, config: SchedulerConfig) -> bool:
    """vLLM's: a prefill of more than `long_prefill_token_threshold` tokens (none when 0)."""
    return 0 < config.long_prefill_token_threshold < num_tokens


def prefill_slot(
    running: list[Request],
    num_scheduled: dict[str, int],
    config: SchedulerConfig,
    num_new: int,
    num_chunk: int,
) -> PrefillSlot:
    """Whether a prompt with `num_new` tokens to compute, `num_chunk` of them in this step, may
    start now. One that finishes in this chunk never spans steps, so it always may. Running
    prefills count when they go on past this step, as long by what they had left at its start
    (`num_scheduled`: this step's tokens so far)."""
    if num_chunk >= num_new:
        return PrefillSlot.FREE
    left = [
        (request, remaining_prefill(request))
        for request in running
        if remaining_prefill(request) > 0
    ]
    if len(left) >= config.max_num_partial_prefills:
        return PrefillSlot.FULL
    if is_long(num_new, config):
        num_long = sum(
            is_long(num_left + num_scheduled.get(request.seq_id, 0), config)
            for request, num_left in left
        )
        if num_long >= config.max_long_partial_prefills:
            return PrefillSlot.LONG_HELD
    return PrefillSlot.FREE


def num_blocks_reserved(running: list[Request], block_manager) -> int:
    """Device blocks the running requests will take without any new admission: the rest of
    each prompt still prefilling, and one block each for decoding past its tail."""
    return sum(
        block_manager.num_blocks_needed(request, remaining_prefill(request)) + 1
        for request in running
    )


def prompt_fits(
    request: Request, num_new: int, hits: list, running: list[Request], block_manager
) -> bool:
    """Whether the request's whole remaining prompt (`num_new` tokens past its prefix `hits`)
    fits beside what the running requests will take (reserve_prompt_blocks). With nothing
    running there is nothing to preempt: allocation alone decides. Cached hits sitting free
    count as free here too (a block of slack); allocate_slots still checks them exactly."""
    if not running:
        return True
    needed = block_manager.num_blocks_needed(request, num_new, hits)
    return needed + num_blocks_reserved(running, block_manager) <= block_manager.num_free_blocks
