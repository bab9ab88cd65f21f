"""The C prefill-attention kernel (kernels/cpu/paged_prefill.c) against its torch twin
(reference.chunk_attention_ref) and dense attention, built for this host and for AVX2; and
greedy tokens equal to transformers' with it on."""

import pytest
import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.kernels import cpu_decode, cpu_prefill
from kvpager.kernels.reference import chunk_attention_ref, paged_attention_ref, quantise_ref

from tests.engine.model.test_parity import assert_all_free, hf_greedy
from tests.kernels.test_paged_attention import assert_close, dense_attention, make_batch
from tests.models import build_llama

pytestmark = pytest.mark.skipif(cpu_prefill.load() is None, reason="no C compiler here")

AVX2 = "x86-64-v3"
# (q_lens, seq_lens): decode rows and short chunks (left alone), chunks across query tiles,
# after cached context, one longer than a 64-key step, a 1-token context
CASES = {
    "mixed": ([1, 5, 40, 130, 9], [200, 5, 90, 300, 9]),
    "after context": ([17, 70, 8], [100, 70, 1000]),
}
# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2's 9/3/64, MQA at 128, GQA 9:1 at 80
# (a head_dim not a multiple of four vectors), 16 heads a kv head, one token a block
SHAPES = [(9, 3, 64, 16), (8, 1, 128, 16), (18, 2, 80, 16), (32, 2, 32, 8), (4, 2, 64, 1)]
MASKS = {  # (window, softcap, sinks)
    "causal": (0, 0.0, False),
    "window": (20, 0.0, True),
    "chunked": (-32, 30.0, False),
    "softcap": (0, 5.0, True),
}


def _run(batch, min_q_len, window, softcap, sinks, march, kv_scales=(1.0, 1.0)):
    """(kernel, twin) fp32 outputs; rows of chunks under min_q_len hold a sentinel in both."""
    query = batch.query.float()
    tensors = (batch.key_cache, batch.value_cache, batch.block_tables, batch.cu_seqlens_q)
    args = (*tensors, batch.seq_lens, 0.125)
    out, twin = torch.full(query.shape, 7.0), torch.full(query.shape, 7.0)
    taken = cpu_prefill.prefill_chunks(
        query, *args, min_q_len, out, window, softcap, kv_scales, sinks, march=march
    )
    assert taken
    q_lens = batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]
    chunk_attention_ref(query, *args, q_lens >= min_q_len, twin, window, softcap, kv_scales, sinks)
    return out, twin


@pytest.mark.parametrize("march", ["native", AVX2])
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_twin(case, shape, mask, march):
    """Scrambled block ids, garbage in spare blocks and table padding, every mask."""
    window, softcap, with_sinks = MASKS[mask]
    batch = make_batch(*CASES[case], *shape, torch.float32, "cpu")
    sinks = torch.randn(shape[0], generator=torch.Generator().manual_seed(3)) * 2
    out, twin = _run(batch, 8, window, softcap, sinks if with_sinks else None, march)
    assert_close("vs twin", out, twin, torch.float32)


@pytest.mark.parametrize("march", ["native", AVX2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrow_pages_are_widened_in_place(dtype, march):
    """bf16 pages, and fp8 pages with their scales, read as the twin's dequantised gather."""
    batch = make_batch(*CASES["mixed"], 9, 3, 64, 16, torch.float32, "cpu")
    kv_scales = (0.37, 1.6) if dtype != torch.bfloat16 else (1.0, 1.0)
    batch.key_cache = quantise_ref(batch.key_cache, dtype, kv_scales[0])
    batch.value_cache = quantise_ref(batch.value_cache, dtype, kv_scales[1])
    out, twin = _run(batch, 2, 16, 0.0, None, march, kv_scales)
    assert_close("vs twin", out, twin, torch.float32)


def test_matches_dense_attention():
    """Against plain fp64 attention on the dense K/V, not only the twin."""
    batch = make_batch(*CASES["mixed"], 9, 3, 64, 16, torch.float32, "cpu")
    out, _ = _run(batch, 1, 0, 0.0, None, "native")
    assert_close("vs dense", out, dense_attention(batch, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_backend_routes_chunks_to_it(dtype, monkeypatch):
    """paged_attention_cpu: chunks of prefill_min_chunk tokens or more on the kernel (3 over
    an fp32 cache, 8 over bf16), a query view of a fused qkv row included; the twin's answer."""
    calls = []
    real = cpu_prefill.prefill_chunks
    monkeypatch.setattr(
        cpu_prefill, "prefill_chunks", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    min_chunk = cpu_decode.PREFILL_MIN_CHUNK_F32 if dtype == torch.float32 else 8
    q_lens = [1, min_chunk - 1, min_chunk, 70]
    batch = make_batch(q_lens, [50, 7, 8, 300], 9, 3, 64, 16, dtype, "cpu")
    assert cpu_decode.prefill_min_chunk(batch.key_cache) == min_chunk
    fused = torch.cat([batch.query, torch.randn(batch.query.shape).to(dtype)], dim=1)
    batch.query = fused[:, :9]  # rows apart, as the executor's qkv view
    args = batch.args(0.125)
    out = cpu_decode.paged_attention_cpu(*args)
    assert calls and out.dtype == dtype
    assert_close("vs twin", out, paged_attention_ref(*args), dtype)


def test_declines_what_it_does_not_take():
    """head_dim not a multiple of the lanes: not fitted (the backend keeps its old path); a
    chunk longer than its context: declined, nothing written."""
    library = cpu_prefill.load()
    narrow = make_batch([9], [9], 4, 2, library.prefill_lanes() // 2, 8, torch.float32, "cpu")
    assert not cpu_prefill.fits(narrow.query, narrow.key_cache, narrow.value_cache)
    args = narrow.args(0.125)
    assert_close(
        "fallback", cpu_decode.paged_attention_cpu(*args), paged_attention_ref(*args), torch.float32
    )
    batch = make_batch([20], [20], 9, 3, 64, 16, torch.float32, "cpu")
    out = torch.full(batch.query.shape, 7.0)
    bad_lens = torch.tensor([10], dtype=torch.int32)
    tensors = (batch.key_cache, batch.value_cache, batch.block_tables, batch.cu_seqlens_q)
    assert not cpu_prefill.prefill_chunks(batch.query, *tensors, bad_lens, 0.125, 1, out)
    assert (out == 7.0).all()


@pytest.fixture(scope="module")
def smol_shaped_llama(tmp_path_factory):
    """A tiny Llama with SmolLM2's head layout (3 query heads a kv head) at head_dim 32."""
    return build_llama(
        tmp_path_factory.mktemp("prefill-llama"), num_attention_heads=6, num_key_value_heads=2,
        head_dim=32, hidden_size=96,
    )  # fmt: skip


def test_greedy_equals_transformers_with_the_kernel(smol_shaped_llama, monkeypatch):
    """fp32, chunked prefill (40-token chunks, so later chunks attend over cached context),
    the kernel on for every chunk of 8 tokens or more: transformers' greedy tokens."""
    calls = []
    real = cpu_prefill.prefill_chunks
    monkeypatch.setattr(
        cpu_prefill, "prefill_chunks", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    prompts = [[(7 * i + 3 * n) % 380 + 3 for i in range(n)] for n in (9, 23, 64, 150, 333)]
    expected = hf_greedy(smol_shaped_llama, prompts, 12)
    llm = LLM(
        str(smol_shaped_llama), dtype="float32", block_size=16, num_blocks=128,
        attention_backend="cpu", device="cpu", max_num_batched_tokens=40,
    )  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls
    assert_all_free(llm)


def test_avx2_build_takes_eight_lane_heads():
    """An AVX2 host's build runs 8-lane vectors: head_dim 8 (the tiny test models') fits it."""
    assert cpu_prefill.load(AVX2).prefill_lanes() == 8
    batch = make_batch(*CASES["mixed"], 4, 2, 8, 8, torch.float32, "cpu")
    out, twin = _run(batch, 8, 5, 0.0, None, AVX2)
    assert_close("vs twin", out, twin, torch.float32)
