"""Dynamo's prefill/decode disaggregation over kvpager's KV transfer (NIXL).

Dynamo's frontend sends a request to a prefill worker first; that worker's last chunk carries
`disaggregated_params`, which the frontend hands to a decode worker as the request's
`prefill_result`. Ours (under the "kvpager" key, JSON-safe: bytes as base64):

    prefill  the prompt runs to one token (max_tokens 1, `hold_kv`): its blocks stay held
             (Scheduler.hold_at_finish); the chunk says finish_reason "length" (Dynamo calls
             decode only then) with {"agent": our KvAgent card, "handoff": the KvHandoff,
             "num_prompt_tokens"}; the blocks go free when the decode side's read notifies
             us, or when the hold expires (kv_moves.HOLD_S).
    decode   the card is checked and connected, the request admitted with `kv_import`: all
             prompt tokens but the last come over NIXL, the last is computed here and gives
             the first token (as vLLM's decode does). A refused card or a failed read
             recomputes the prompt.

Nothing from the wire is trusted: the structs are converted strictly, the prompt length must
match, the card must describe a cache like ours (KvRegions.check_peer), and the scheduler
checks the block tables' shape (KvMoves._import_fits) before it allocates anything.
"""

from typing import Any

import msgspec
import structlog
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.async_kv import AsyncKvMoves
from kvpager.engine.request import Request
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.engine.worker.kv_transfer.endpoint import executor_regions
from kvpager.schemas.errors import ConfigError, KvTransferError
from kvpager.schemas.kv_transfer import KvAgent, KvHandoff

log = structlog.get_logger(__name__)

PARAMS_KEY = "kvpager"


def kv_moves(engine: AsyncEngine, name: str) -> AsyncKvMoves:
    """The engine's KV moves over NIXL (a ConfigError where NIXL or the cache cannot move:
    Dynamo's workers have no NATS link for kvpager's fallback)."""
    regions = executor_regions(engine.runner.executor)
    if regions is None:
        raise ConfigError("--disaggregation-mode: tensor-parallel caches do not move yet")
    if not nixl.available():
        raise ConfigError("--disaggregation-mode needs NIXL: pip install 'kvpager[nixl]'")
    try:
        transfer = nixl.NixlTransfer(regions, name, name)
    except KvTransferError as exc:
        raise ConfigError(f"--disaggregation-mode: {exc}") from exc
    return AsyncKvMoves(engine, transfer)


def as_prefill(request: Request) -> None:
    """Run the prompt to its first token only, keeping its blocks for the decode side."""
    request.sampling_params.max_tokens = 1
    request.sampling_params.min_tokens = 0
    request.hold_kv = True


def prefill_params(handoff: KvHandoff, card: KvAgent, num_prompt_tokens: int) -> dict[str, Any]:
    handoff.instance, handoff.agent = card.instance, card.name
    held = {"agent": card, "handoff": handoff, "num_prompt_tokens": num_prompt_tokens}
    return {PARAMS_KEY: msgspec.to_builtins(held)}


async def import_kv(payload: dict, request: Request, moves: AsyncKvMoves) -> bool:
    """Admit `request` with the prefill's blocks to read (kv_import); False: it recomputes
    (no params, or params refused: logged)."""
    params = ((payload.get("prefill_result") or {}).get("disaggregated_params") or {}).get(
        PARAMS_KEY
    )
    if params is None:
        return False
    try:
        card, handoff = parse_params(params, request)
        await moves.connect(card)
    except (KvTransferError, msgspec.ValidationError, TypeError, ValueError) as exc:  # recompute
        log.warning("disaggregated params refused: recomputing", error=str(exc))
        return False
    request.kv_import = all_but_last(handoff, moves.engine.block_size)
    return request.kv_import is not None


def parse_params(params: Any, request: Request) -> tuple[KvAgent, KvHandoff]:
    if not isinstance(params, dict):
        raise TypeError("disaggregated_params.kvpager: must be an object")
    card = msgspec.convert(params.get("agent"), KvAgent)
    handoff = msgspec.convert(params.get("handoff"), KvHandoff)
    if params.get("num_prompt_tokens") != request.num_prompt_tokens:
        raise ValueError("disaggregated_params: the prefill ran another prompt")
    if handoff.agent != card.name or handoff.num_computed_tokens != request.num_prompt_tokens:
        raise ValueError("disaggregated_params: the handoff does not match its card")
    return card, handoff


def all_but_last(handoff: KvHandoff, block_size: int) -> KvHandoff | None:
    """The prompt's K/V but its last token's, which this side computes for the first token."""
    num_tokens = handoff.num_computed_tokens - 1
    if num_tokens <= 0:
        return None
    num_blocks = -(-num_tokens // block_size)
    tables = [table[:num_blocks] for table in handoff.block_tables]
    return KvHandoff(handoff.transfer_id, handoff.instance, handoff.agent, tables, num_tokens)
