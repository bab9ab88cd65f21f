"""The executor's proposer, by `speculative_config.method`: one small interface for both."""

from typing import Protocol

from kvpager.engine.config import SpeculativeConfig
from kvpager.engine.worker.input_batch import InputBatch, RequestState
from kvpager.engine.worker.spec_decode.ngram_proposer import NgramProposer
from kvpager.engine.worker.spec_decode.suffix_proposer import SuffixProposer


class Proposer(Protocol):
    def propose_for(
        self, batch: InputBatch, num_spec_tokens: dict[str, int]
    ) -> dict[str, list[int]]:
        """Proposals for the sequences a step asked (seq id -> k), after its tokens."""
        ...

    def remove(self, batch: InputBatch, state: RequestState) -> None:
        """`state`'s row is about to leave the request table."""
        ...


def make_proposer(config: SpeculativeConfig | None, draft: Proposer | None = None) -> Proposer:
    """`draft`: the executor's draft-model proposer, which owns a view of its cache."""
    spec = config or SpeculativeConfig()  # sizes for when asked
    if spec.method == "draft_model":
        assert draft is not None, "a draft_model config without its draft"
        return draft
    if spec.method == "suffix":
        return SuffixProposer(spec)
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
