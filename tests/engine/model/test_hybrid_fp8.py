"""fp8 KV on recurrent hybrids (Granite 4's Mamba2, Qwen3-Next's gated DeltaNet): the
attention layers' blocks in fp8 and the recurrent states in the model's dtype. Checked two
ways: exactly equal (tokens and logprobs) to a float32 cache that stores each K/V value as
the fp8 cache rounds it (kernels/reference.py's quantise_ref, widened back), so fp8 is
written and read right beside the states; and close to the float32 cache in vLLM's
check_logprobs_close sense over the first token, as test_fp8_cache.py holds e5m2 (on these
random models an fp8 rounding can move a later near tie, and the recurrent state carries
it on). More blocks in the same budget; every block and state slot free after."""

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.kernels import reference

from tests.engine.helpers import make_llm, random_prompts
from tests.engine.model.hybrid_checks import assert_slots_free
from tests.engine.worker.test_fp8_cache import check_logprobs_close
from tests.model_families import build_granite_hybrid, build_qwen3_next

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
BUDGET = dict(num_blocks=None, kv_cache_memory=1 << 20, max_num_seqs=8)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module", params=["granite", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    build = {"granite": build_granite_hybrid, "qwen3_next": build_qwen3_next}[request.param]
    return build(tmp_path_factory.mktemp(request.param))


def _generate(path, prompts, **overrides):
    with make_llm(path, **BUDGET, **overrides) as llm:
        outputs = llm.generate(prompts, PARAMS)
        assert_slots_free(llm)
    return outputs


def _rounded_like(monkeypatch, fp8_dtype: torch.dtype) -> None:
    """A float32 cache stores each value as an fp8 cache of `fp8_dtype` would read it."""
    quantise = reference.quantise_ref

    def rounded(x, cache_dtype, scale):
        if cache_dtype != torch.float32:
            return quantise(x, cache_dtype, scale)
        return quantise(x, fp8_dtype, scale).float() * scale

    monkeypatch.setattr(reference, "quantise_ref", rounded)


@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_attention_beside_states_in_the_model_dtype(hybrid, kv_cache_dtype, monkeypatch):
    prompts = random_prompts([3, 9, 17, 30, 45], seed=11)
    with make_llm(hybrid, kv_cache_dtype=kv_cache_dtype, **BUDGET) as fp8:
        executor = fp8.executor
        assert executor.kv_cache.dtype == executor.cpu_cache.dtype == FP8[kv_cache_dtype]
        states = executor.state_cache.states
        assert states.conv.dtype == torch.float32 and states.ssm.dtype == torch.float32
        got = fp8.generate(prompts, PARAMS)
        assert_slots_free(fp8)
    with make_llm(hybrid, **BUDGET) as full:
        # the same slots out of the same budget; the rest holds 4x the float32 blocks' count
        assert executor.pool.num_slots == full.executor.pool.num_slots
        assert executor.num_blocks > 3 * full.executor.num_blocks
    expected = _generate(hybrid, prompts)
    first = [check_logprobs_close([ref], [out], 5, max_tokens=1) for ref, out in zip(expected, got)]
    assert sum(first) >= len(prompts) - 1
    _rounded_like(monkeypatch, FP8[kv_cache_dtype])
    for ref, out in zip(_generate(hybrid, prompts), got, strict=True):
        ref, out = ref.outputs[0], out.outputs[0]
        assert out.token_ids == ref.token_ids
        assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(
            [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4
        )
