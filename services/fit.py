"""Internal messages cut to fit the wire: NATS refuses a payload over the server's
`max_payload` (1 MiB by default), and an oversized publish would otherwise raise in a loop that
serves every request. Each hop measures what it sends and cuts what can be cut, by construction:

    scheduler -> executor   StepRequests* (leading NewRequests), then the RunStep
    executor -> scheduler   StepPart* (beam candidates, prompt-logprob rows), then the StepDone
    scheduler -> tokenizer  TokenBatch* per subject, a delta's prompt logprobs over several deltas

What cannot be cut (one sequence's sampling params, one beam row's candidates) is bounded at
admission (services/tokenizer/limits.py, the scheduler's check of the sampling params).
"""

import msgspec
from kvpager.schemas.executor import NewRequest, ScheduledStep
from kvpager.schemas.scheduler import PromptLogprobs, StepDone, StepPart
from kvpager.schemas.tokenizer import SampleDelta
from kvpager.services.wire import pack, pack_within

_ROWS = ("logprobs", "ranks", "top_token_ids", "top_logprobs")


def size(message) -> int:
    return len(pack(message))


def split_step(step: ScheduledStep, budget: int) -> tuple[list[list[NewRequest]], ScheduledStep]:
    """Runs of new requests to send ahead (StepRequests), and the step left to send; no cut
    when the step fits already."""
    if size(step) <= budget:
        return [], step
    ahead = pack_within(step.new_requests, budget)
    return ahead, msgspec.structs.replace(step, new_requests=[])


def split_rows(logprobs: PromptLogprobs, budget: int) -> list[PromptLogprobs]:
    """Consecutive row slices of `logprobs` (their `start`s follow on), each within `budget`."""
    num = len(logprobs)
    if num <= 1 or size(logprobs) <= budget:
        return [logprobs]
    row_bytes = max(size(_rows(logprobs, i, i + 1)) for i in (0, num - 1))
    per_slice = max(1, budget // (2 * row_bytes))  # rows vary a little: half the room
    return [_rows(logprobs, lo, min(num, lo + per_slice)) for lo in range(0, num, per_slice)]


def _rows(logprobs: PromptLogprobs, lo: int, hi: int) -> PromptLogprobs:
    return PromptLogprobs(logprobs.start + lo, *(getattr(logprobs, name)[lo:hi] for name in _ROWS))


def join_rows(slices: list[PromptLogprobs]) -> PromptLogprobs:
    """The slices of `split_rows` put back together; ValueError if they do not follow on."""
    first = slices[0]
    joined = PromptLogprobs(first.start, *([] for _ in _ROWS))
    for piece in slices:
        if piece.start != joined.start + len(joined):  # off the wire: a part was lost
            raise ValueError(f"prompt logprobs slices out of order at {piece.start}")
        for name in _ROWS:
            getattr(joined, name).extend(getattr(piece, name))
    return joined


def split_done(done: StepDone, budget: int) -> tuple[list[StepPart], StepDone]:
    """StepParts to send ahead (each within `budget`), and the StepDone left to send; no cut
    when the output fits already. Only the per-sequence outputs that can grow large move."""
    if size(done) <= budget:
        return [], done
    output, step_id = done.output, done.output.step_id
    items: list[StepPart] = [
        StepPart(step_id, beam_candidates={seq_id: candidates})
        for seq_id, candidates in output.beam_candidates.items()
    ]
    for seq_id, logprobs in output.prompt_logprobs.items():
        items += [
            StepPart(step_id, prompt_logprobs={seq_id: s}) for s in split_rows(logprobs, budget)
        ]
    parts = [_merge(step_id, run) for run in pack_within(items, budget)]
    rest = msgspec.structs.replace(output, beam_candidates={}, prompt_logprobs={})
    return parts, msgspec.structs.replace(done, output=rest)


def _merge(step_id: int, run: list[StepPart]) -> StepPart:
    merged = StepPart(step_id, beam_candidates={}, prompt_logprobs={})
    for part in run:
        merged.beam_candidates.update(part.beam_candidates)
        for seq_id, logprobs in part.prompt_logprobs.items():
            held = merged.prompt_logprobs.get(seq_id)
            merged.prompt_logprobs[seq_id] = (
                logprobs if held is None else join_rows([held, logprobs])
            )
    return merged


def join_done(parts: list[StepPart], done: StepDone) -> StepDone:
    """A StepDone with the outputs its StepParts carried ahead, in order."""
    if not parts:
        return done
    output = done.output
    candidates = dict(output.beam_candidates)
    slices: dict[str, list[PromptLogprobs]] = {}
    for part in [*parts, StepPart(output.step_id, prompt_logprobs=output.prompt_logprobs)]:
        candidates.update(part.beam_candidates)
        for seq_id, logprobs in part.prompt_logprobs.items():
            slices.setdefault(seq_id, []).append(logprobs)
    joined = {seq_id: join_rows(pieces) for seq_id, pieces in slices.items()}
    output = msgspec.structs.replace(output, beam_candidates=candidates, prompt_logprobs=joined)
    return msgspec.structs.replace(done, output=output)


def split_deltas(deltas: list[SampleDelta], budget: int) -> list[list[SampleDelta]]:
    """Deltas for one subject in TokenBatches that each fit `budget`, in order. A delta with a
    long prompt's logprobs becomes several: the leading rows alone, then the delta with the
    last rows (the tokenizer's Stream joins them)."""
    if size(deltas) <= budget:
        return [deltas]
    cut: list[SampleDelta] = []
    for delta in deltas:
        cut += _split_delta(delta, budget)
    return pack_within(cut, budget)


def _split_delta(delta: SampleDelta, budget: int) -> list[SampleDelta]:
    if delta.prompt_logprobs is None or size(delta) <= budget:
        return [delta]
    *head, last = split_rows(delta.prompt_logprobs, budget // 2)
    leading = [SampleDelta(delta.request_id, delta.index, prompt_logprobs=rows) for rows in head]
    return [*leading, msgspec.structs.replace(delta, prompt_logprobs=last)]
