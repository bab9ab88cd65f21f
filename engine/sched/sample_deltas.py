"""Each request's samples as SampleDeltas: new tokens, final deltas, whole beams.

The engine core's one output form, read by both front doors: the offline `LLM` feeds them to
its output processor in-process, the scheduler service routes them to tokenizer replicas. A
request's samples stay open until their final delta (the one with a `finish_reason`).
"""

from collections.abc import Callable

from kvpager.engine.request import Request
from kvpager.engine.sched.beam_search import FinishedBeam
from kvpager.engine.sched.prompt_logprobs import PromptLogprobsCollector
from kvpager.schemas.kv_transfer import KvHandoff
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import TokenLogprobs
from kvpager.schemas.tokenizer import SampleDelta


class SampleDeltas:
    """Deltas collected since the last `take()`, and the samples still open per request."""

    def __init__(self, on_close: Callable[[str], None], vocab_size: int = 0) -> None:
        self.open: dict[str, set[int]] = {}  # request id -> samples without a final delta
        self.prompt_logprobs = PromptLogprobsCollector(vocab_size)
        self._deltas: list[SampleDelta] = []
        self._on_close = on_close  # called with a request's id after its last final delta
        self._num_sent: dict[tuple[str, int], int] = {}  # (request id, index) -> tokens sent

    def track(self, request_id: str, num_samples: int) -> None:
        self.open[request_id] = set(range(num_samples))

    @property
    def pending(self) -> bool:
        """Whether deltas were collected since the last `take()`."""
        return bool(self._deltas)

    def take(self) -> list[SampleDelta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def add_token(self, request: Request, logprobs: list[TokenLogprobs] | None) -> None:
        """The request's tokens since its last delta (several when proposals were accepted),
        with their logprobs; a final delta too if it has finished."""
        key = (request.request_id, request.sample_index)
        start = self._num_sent.get(key, 0)
        token_ids = request.output_token_ids[start:]
        self._num_sent[key] = request.num_output_tokens
        delta = SampleDelta(
            request.request_id,
            request.sample_index,
            token_ids,
            logprobs=None if logprobs is None else logprobs[: len(token_ids)],
        )
        if start == 0:  # the request's first tokens: the whole prompt's logprobs go with them
            delta.prompt_logprobs = self.prompt_logprobs.take(request)
        if request.is_finished:
            delta.finish_reason = request.status.value
            delta.stop_reason = request.stop_reason
            cache_usage(delta, request)
        self._push(delta)

    def add_beams(self, request_id: str, beams: list[FinishedBeam]) -> None:
        """A beam search's result, whole: the best `n` beams as final deltas, best first."""
        for index, beam in zip(sorted(self.open.get(request_id, ())), beams):
            delta = SampleDelta(
                request_id,
                index,
                beam.token_ids,
                finish_reason=beam.finish_reason,
                cumulative_score=float(beam.score),
            )
            self._push(delta)

    def add_finals(
        self,
        request_id: str,
        finish_reason: str,
        indices: list[int] | None = None,
        error: ErrorInfo | None = None,
        num_cached_tokens: int = 0,
        request: Request | None = None,
        kv_handoff: KvHandoff | None = None,
    ) -> None:
        """Final deltas for the open samples among `indices` (None: every open sample), with
        `request`'s prefix-cache usage when given."""
        open_indices = self.open.get(request_id, set())
        chosen = sorted(open_indices if indices is None else open_indices & set(indices))
        for index in chosen:
            delta = SampleDelta(
                request_id,
                index,
                finish_reason=finish_reason,
                num_cached_tokens=num_cached_tokens,
                error=error,
                kv_handoff=kv_handoff,
            )
            if request is not None:
                cache_usage(delta, request)
            self._push(delta)

    def _push(self, delta: SampleDelta) -> None:
        open_indices = self.open.get(delta.request_id)
        if delta.finish_reason is not None or open_indices is None:
            self._num_sent.pop((delta.request_id, delta.index), None)
        if open_indices is None:
            return  # ended already (failed, aborted): late tokens are dropped
        self._deltas.append(delta)
        if delta.finish_reason is not None:
            open_indices.discard(delta.index)
            if not open_indices:
                del self.open[delta.request_id]
                self.prompt_logprobs.forget(delta.request_id)
                self._on_close(delta.request_id)


def cache_usage(delta: SampleDelta, request: Request) -> None:
    """A final delta's prefix-cache usage: hits (by tier) and pinned writes."""
    delta.num_cached_tokens = request.num_cached_tokens
    delta.num_cache_write_tokens = request.num_cache_write_tokens
    delta.cached_tokens_by_tier = dict(request.cached_tokens_by_tier)
