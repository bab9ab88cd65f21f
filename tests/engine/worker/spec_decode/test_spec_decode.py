"""Speculative decoding (n-gram prompt lookup and suffix decoding): the same tokens as without
it, fewer steps.

The tiny random Llama rarely repeats itself, so proposals would almost never be accepted; the
`looping` checkpoint scales its attention and MLP outputs down (the residual stream, so the
current token, dominates), and its greedy outputs fall into repeated phrases that prompt
lookup predicts, while attention still shapes every token.
"""

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.kernels import cpu_layer_ops
from kvpager.schemas.errors import ConfigError
from transformers import LlamaForCausalLM

from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.models import build_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


@pytest.fixture(params=[SPEC, SUFFIX], ids=["ngram", "suffix"])
def spec(request) -> dict:
    return request.param


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    path = build_llama(tmp_path_factory.mktemp("looping-llama"))
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.003)
            layer.mlp.down_proj.weight.mul_(0.003)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _prompts() -> list[list[int]]:
    repetitive = [list(range(3, 14)) * 3, [40, 41, 42, 43, 44] * 5]
    return repetitive + random_prompts([5, 20, 37], seed=3)


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(looping):
    llm = make_llm(looping)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return _tokens(llm, _prompts(), params)


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def test_greedy_identical_batched_and_alone(looping, expected, spec):
    llm = make_llm(looping, speculative_config=spec)
    assert _tokens(llm, _prompts(), GREEDY) == expected
    alone = [_tokens(llm, [prompt], GREEDY)[0] for prompt in _prompts()]
    assert alone == expected
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 20, stats  # proposals were accepted
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
    num_tokens = 2 * sum(map(len, expected))
    assert stats["num_steps"] < num_tokens / len(expected) + 2 * len(expected) * 48  # sanity
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_identical_under_preemption(looping, expected, mode, spec):
    llm = make_llm(
        looping, speculative_config=spec, num_blocks=20, preemption_mode=mode, plan_ahead=0
    )
    assert _tokens(llm, _prompts(), GREEDY) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert_all_free(llm)


def test_stop_token_and_max_tokens_inside_an_accepted_run(looping, expected, spec):
    llm = make_llm(looping, speculative_config=spec)
    prompt, full = _prompts()[1], expected[1]
    stop_at = full.index(full[30])  # the first occurrence of a token late in the output
    params = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[full[30]])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: stop_at + 1] and out.finish_reason == "stop"
    for max_tokens in (1, 2, 7, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:max_tokens] and out.finish_reason == "length"
    assert_all_free(llm)


def test_stop_string_inside_a_delta_of_several_tokens(looping, expected, spec):
    base, llm = make_llm(looping), make_llm(looping, speculative_config=spec)
    prompt = _prompts()[0]
    text = base.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=48, stop=[stop])
    want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert_all_free(llm)


def test_logprobs_and_seeded_sampling_match(looping, spec):
    base, llm = make_llm(looping), make_llm(looping, speculative_config=spec)
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    want = base.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        w_lp, g_lp = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert len(g_lp) == len(w_lp) == 32
        for token_id, a, b in zip(w.outputs[0].token_ids, w_lp, g_lp):
            assert list(a) == list(b)  # the sampled token, then the same alternatives
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)
    seeded = [
        SamplingParams(temperature=0.6, seed=s, max_tokens=32, ignore_eos=True) for s in (1, 2)
    ]
    assert _tokens(llm, prompts, seeded) == _tokens(base, prompts, seeded)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(llm)


def test_parallel_samples_and_prefix_sharing(looping, expected, spec):
    llm = make_llm(looping, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, n=3)
    outs = llm.generate(_prompts()[:2], params, use_tqdm=False)
    for out, want in zip(outs, expected):
        assert [o.token_ids for o in out.outputs] == [want] * 3
    assert_all_free(llm)


def test_speculation_steps_aside_for_a_large_batch(looping, expected, spec):
    config = {**spec, "max_num_seqs_to_speculate": 2}
    llm = make_llm(looping, speculative_config=config)
    lengths = [48, 48, 12, 16, 20]  # 5 running: off until 2 are left
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [tokens[:n] for tokens, n in zip(expected, lengths)]
    assert _tokens(llm, _prompts(), params) == want
    assert llm.scheduler.lookahead.stats.num_drafts > 0
    assert_all_free(llm)


def test_suffix_decoding_reuses_an_earlier_requests_output(looping):
    """A prompt never seen, asked twice in turn: the second time the first's output is in the
    global cache and is proposed from its first token; without the cache it is not."""
    prompt = random_prompts([24], seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = _tokens(make_llm(looping), [prompt], params)
    accepted = {}
    for num_cached in (0, 4):
        config = {**SUFFIX, "suffix_decoding_max_cached_requests": num_cached}
        llm = make_llm(looping, speculative_config=config)
        assert _tokens(llm, [prompt], params) == want
        before = llm.stats()["spec_decode_num_accepted_tokens"]
        assert _tokens(llm, [prompt], params) == want
        accepted[num_cached] = llm.stats()["spec_decode_num_accepted_tokens"] - before
        assert len(llm.executor.proposer.cache) == min(num_cached, 2)
        assert_all_free(llm)
    assert accepted[4] > accepted[0] + 10, accepted


def test_suffix_decoding_pauses_a_request_that_is_rarely_accepted(looping, expected):
    config = {**SUFFIX, "min_acceptance_rate": 1.0}  # any rejection in a window pauses
    llm = make_llm(looping, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    got = _tokens(llm, _prompts(), params)
    assert [tokens[:48] for tokens in got] == expected
    assert llm.scheduler.lookahead.stats.num_pauses > 0
    assert_all_free(llm)


@pytest.mark.skipif(cpu_layer_ops.load() is None, reason="no C compiler")
def test_verify_steps_replay_as_decode_rows(looping):
    """On the cpu backend a verify step (several tokens of a sequence) replays a decode graph
    of a row per token (engine/worker/decode_graphs.py): one stream's speculation captures
    graphs of several rows, and speculation alone and batched gives plain decoding's tokens,
    as it does eagerly."""
    cpu = dict(attention_backend="cpu")
    prompts = _prompts()
    base = make_llm(looping, **cpu)
    plain = _tokens(base, prompts, GREEDY)
    assert_all_free(base)
    runs = {}
    for eager in (True, False):
        llm = make_llm(looping, speculative_config=SUFFIX, enforce_eager=eager, **cpu)
        alone = _tokens(llm, prompts[:1], GREEDY)
        if not eager:  # one stream decodes one row a step: the larger graphs are verify steps
            assert max(llm.executor.graphs.graphs) > 1, llm.executor.graphs.graphs
        runs[eager] = alone + _tokens(llm, prompts, GREEDY)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 20
        assert_all_free(llm)
    assert runs[False] == runs[True] == plain[:1] + plain


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "eagle"}, "supported: ngram, suffix, draft_model"),
        ({"method": "draft_model"}, "model: give it for method draft_model only"),
        ({"method": "ngram", "model": "x"}, "model: give it for method draft_model only"),
        ({"model": 3}, "model must be a path"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_speculative_tokens": "4"}, "integers"),
        ({"k": 3}, "unknown fields"),
        ("{not json", "not JSON"),
    ],
)
def test_bad_speculative_config(config, match):
    from kvpager.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=match):
        EngineConfig(speculative_config=config)
