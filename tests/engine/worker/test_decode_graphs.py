"""Decode graphs (engine/worker/decode_graphs.py): decode steps on the cpu backend replay their
captured kernel calls, one graph per batch size, with the tokens of eager steps and of
transformers; models whose layers work outside the kernels run eagerly; a replay whose kernel
answers otherwise falls back; `enforce_eager` turns graphs off."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.worker import decode_graphs
from kvpager.kernels import cpu_graph, cpu_layer_ops, cpu_tiles
from kvpager.kernels.cpu_graph import CallGraph

from tests import model_families
from tests.engine.helpers import assert_all_free, hf_generate, make_llm, random_prompts
from tests.models import build_llama

pytestmark = pytest.mark.skipif(cpu_layer_ops.load() is None, reason="no C compiler")
CPU = dict(attention_backend="cpu")
LENGTHS = [3, 9, 17, 30, 5]
# different lengths of output: the batch shrinks, so several batch sizes are captured
MAX_TOKENS = [6, 9, 12, 12, 15]


def _greedy(llm, prompts) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _eager(path, prompts, **overrides) -> list[list[int]]:
    llm = make_llm(path, enforce_eager=True, **CPU, **overrides)
    assert llm.executor.graphs is None
    outputs = _greedy(llm, prompts)
    assert_all_free(llm)
    return outputs


def test_replayed_decode_steps_give_the_eager_tokens_and_transformers(tiny_llama):
    prompts = random_prompts(LENGTHS, seed=3)
    llm = make_llm(tiny_llama, **CPU)
    outputs = _greedy(llm, prompts)
    graphs = llm.executor.graphs
    assert not graphs.off
    # the batch sizes decode steps ran at, and the prompts' step (64 tokens in chunks of at
    # most 30: MAX_ROW_TOKENS) as a row per token
    assert sorted(graphs.graphs) == [1, 3, 4, 5, sum(LENGTHS)]
    assert outputs == _eager(tiny_llama, prompts)
    expected = [hf_generate(tiny_llama, [p], max_new_tokens=n, do_sample=False)[0]
                for p, n in zip(prompts, MAX_TOKENS)]  # fmt: skip
    assert outputs == expected
    assert_all_free(llm)


def test_q_k_norms_replay_over_the_heads_in_place(tmp_path):
    """Qwen3's q/k norms read each head inside the qkv rows (no gathered copy to refuse)."""
    path = model_families.build_qwen3(tmp_path)
    prompts = random_prompts(LENGTHS, seed=9)
    llm = make_llm(path, **CPU)
    outputs = _greedy(llm, prompts)
    assert not llm.executor.graphs.off and llm.executor.graphs.graphs
    assert outputs == _eager(path, prompts)
    assert_all_free(llm)


def test_sliding_windows_and_kv_groups_replay(tmp_path):
    """Mistral's window on every layer (the prompts run past it), Gemma 2 and 3, and Qwen3
    with sliding and full layers in turn: two KV groups, a metadata set and block tables for
    each."""
    builds = {
        "mistral": lambda p: model_families.build_mistral(p),
        "gemma2": lambda p: model_families.build_gemma2(p),  # GeGLU, soft-caps, windows
        # q/k norms, local RoPE, two groups; head_dim 32: every linear on the C kernels
        "gemma3": lambda p: model_families.build_gemma3(p, head_dim=32),
        "qwen3-groups": lambda p: model_families.build_qwen3(
            p, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
            use_sliding_window=True, max_window_layers=0,
        ),
    }  # fmt: skip
    prompts = random_prompts(LENGTHS, seed=10)
    for name, build in builds.items():
        path = build(tmp_path / name)
        llm = make_llm(path, **CPU)
        outputs = _greedy(llm, prompts)
        assert not llm.executor.graphs.off and llm.executor.graphs.graphs, name
        if name == "qwen3-groups":
            assert llm.executor.kv_groups.num_groups == 2
        assert outputs == _eager(path, prompts), name
        expected = [hf_generate(path, [p], max_new_tokens=n, do_sample=False)[0]
                    for p, n in zip(prompts, MAX_TOKENS)]  # fmt: skip
        # transformers stops at an end token, where kvpager's ignore_eos runs on
        assert [out[: len(want)] for out, want in zip(outputs, expected)] == expected, name
        assert_all_free(llm)


def test_seeded_sampling_draws_the_same_tokens_replayed(tiny_llama):
    prompts = random_prompts(LENGTHS, seed=4)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=10) for i in range(5)]
    runs = []
    for eager in (False, True):
        llm = make_llm(tiny_llama, enforce_eager=eager, **CPU)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert_all_free(llm)
    assert runs[0] == runs[1]


def test_layers_that_compute_outside_the_kernels_run_eagerly(tmp_path):
    path = model_families.build_mixtral(tmp_path)  # the experts' routing runs in torch
    prompts = random_prompts(LENGTHS, seed=5)
    llm = make_llm(path, **CPU)
    outputs = _greedy(llm, prompts)
    assert llm.executor.graphs.off and not llm.executor.graphs.graphs
    assert outputs == _eager(path, prompts)
    assert_all_free(llm)


def test_a_large_batch_refused_keeps_graphs_for_small_ones(tiny_llama, monkeypatch):
    """As on a host without AMX, where a batch past the C small-row linears runs oneDNN's
    matmul (outside the kernels): such a capture refused, larger batches run eagerly and the
    small ones still replay, with the eager tokens."""
    capture = cpu_graph.capture

    def refusing_large(region, inputs, *args):
        if len(inputs[0]) > 3:
            raise cpu_graph.CaptureError("computes outside the kernels (_linear_pointwise)")
        return capture(region, inputs, *args)

    monkeypatch.setattr(decode_graphs, "KERNEL_ROWS", 3)
    monkeypatch.setattr(cpu_graph, "capture", refusing_large)
    prompts = random_prompts(LENGTHS, seed=8)
    llm = make_llm(tiny_llama, **CPU)
    outputs = _greedy(llm, prompts)
    graphs = llm.executor.graphs
    assert not graphs.off and graphs.max_rows == 3
    assert sorted(graphs.graphs) == [1, 3]  # of the sizes decode steps ran at: 5, 4, 3, 1
    assert outputs == _eager(tiny_llama, prompts)
    assert_all_free(llm)


def test_a_replay_a_kernel_answers_otherwise_falls_back_and_captures_anew(tiny_llama):
    prompts = random_prompts(LENGTHS, seed=6)
    # no prefix cache: the prompts' step runs again whole, on its graph (64 rows)
    llm = make_llm(tiny_llama, enable_prefix_caching=False, **CPU)
    first = _greedy(llm, prompts)
    graphs = llm.executor.graphs
    tampered = {}
    for rows, (inputs, graph) in list(graphs.graphs.items()):
        fn, args, status = graph.calls[0]
        calls = [(fn, args, status + 1), *graph.calls[1:]]  # a status the replay will not see
        tampered[rows] = CallGraph(calls, graph.output, graph.buffers)
        graphs.graphs[rows] = (inputs, tampered[rows])
    assert _greedy(llm, prompts) == first
    assert not graphs.off
    for rows, (_, graph) in graphs.graphs.items():
        assert graph is not tampered.get(rows)
    assert_all_free(llm)


def test_graphs_kept_are_bounded(tiny_llama, monkeypatch):
    monkeypatch.setattr(decode_graphs, "MAX_GRAPHS", 2)
    llm = make_llm(tiny_llama, **CPU)
    prompts = random_prompts(LENGTHS, seed=7)
    assert _greedy(llm, prompts) == _eager(tiny_llama, prompts)
    assert len(llm.executor.graphs.graphs) == 2
    assert_all_free(llm)


@pytest.mark.skipif(not cpu_tiles.available(), reason="neither AMX nor AVX512-BF16 on this host")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_on_the_tile_layout_replays_the_eager_tokens(tmp_path, family):
    if family == "llama":
        path = build_llama(tmp_path, head_dim=32)  # a head size the tiles take
    else:
        path = model_families.build_qwen3(tmp_path)
    tiles = dict(dtype="bfloat16", block_size=16)
    prompts = random_prompts(LENGTHS, seed=8)
    llm = make_llm(path, **tiles, **CPU)
    assert llm.executor.ops.kv_layout == cpu_tiles.LAYOUT
    outputs = _greedy(llm, prompts)
    assert not llm.executor.graphs.off and llm.executor.graphs.graphs
    assert outputs == _eager(path, prompts, **tiles)
    assert_all_free(llm)
