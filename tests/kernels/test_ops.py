"""Every backend's implementation of a kernel op satisfies its contract in kernels/ops.py:
the same positional parameters, by name and in order; anything extra has a default."""

import inspect

import pytest
from kvpager.kernels import (
    backend,
    block_ops,
    cpu_decode,
    cpu_layer_ops,
    cpu_mla,
    cpu_tiles,
    kv_write,
    mla_attention,
    moe,
    ops,
    paged_attention,
    reference,
    reference_mla,
    reference_moe,
)

IMPLEMENTATIONS = {
    "reshape_and_cache": [
        reference.reshape_and_cache_ref,
        cpu_layer_ops.reshape_and_cache,
        kv_write.reshape_and_cache,
        cpu_tiles.reshape_and_cache_tiles,
        cpu_tiles.reshape_and_cache_tiles_ref,
    ],
    "paged_attention": [
        reference.paged_attention_ref,
        cpu_decode.paged_attention_cpu,
        paged_attention.paged_attention,
        cpu_tiles.paged_attention_tiles,
        cpu_tiles.paged_attention_tiles_ref,
    ],
    "copy_blocks": [reference.copy_blocks_ref, block_ops.copy_blocks],
    "swap_blocks": [reference.swap_blocks_ref, block_ops.swap_blocks],
    "rotary": [reference.rotary_ref, cpu_layer_ops.rotary],
    "add_rms_norm": [reference.add_rms_norm_ref, cpu_layer_ops.add_rms_norm],
    "silu_and_mul": [reference.silu_and_mul_ref, cpu_layer_ops.silu_and_mul],
    "gelu_tanh_and_mul": [reference.gelu_tanh_and_mul_ref],
    "gelu_and_mul": [reference.gelu_and_mul_ref],
    "fused_moe": [reference_moe.fused_moe_ref, moe.fused_moe],
    "mla_attention": [
        reference_mla.mla_paged_attention_ref,
        cpu_mla.mla_attention_cpu,
        mla_attention.mla_paged_attention,
    ],
}


KEYWORD = inspect.Parameter.KEYWORD_ONLY


def _contract_params(name: str) -> list[inspect.Parameter]:
    params = inspect.signature(ops.CONTRACTS[name].__call__).parameters.values()
    return [p for p in params if p.name != "self"]


def _satisfies(function, contract: list[inspect.Parameter]) -> str | None:
    """Why `function` breaks the contract, or None: the contract's positional parameters by
    name and in order, its keyword-only ones by name, anything else with a default."""
    positional = [p.name for p in contract if p.kind != KEYWORD]
    keywords = {p.name for p in contract if p.kind == KEYWORD}
    params = list(inspect.signature(function).parameters.values())
    names = [p.name for p in params if p.kind != KEYWORD][: len(positional)]
    if names != positional:
        return f"parameters {names}, the contract has {positional}"
    missing = keywords - {p.name for p in params}
    if missing:
        return f"lacks the contract's keywords {sorted(missing)}"
    known = set(positional) | keywords
    extra = [p.name for p in params if p.name not in known and p.default is inspect.Parameter.empty]
    return f"extra parameters without defaults: {extra}" if extra else None


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_every_implementation_satisfies_its_contract(name):
    expected = _contract_params(name)
    for function in IMPLEMENTATIONS[name]:
        problem = _satisfies(function, expected)
        assert problem is None, f"{function.__module__}.{function.__name__}: {problem}"


def test_the_contracts_cover_every_op_of_a_backend():
    # every field but the switches (pack_experts) and the cache layout's name is an op
    fields = {
        f.name for f in backend.KernelOps.__dataclass_fields__.values() if f.type not in (bool, str)
    }
    assert fields == set(ops.CONTRACTS) == set(IMPLEMENTATIONS)


def test_a_broken_signature_is_caught():
    def swapped(key, value, value_cache, key_cache, slot_mapping):
        pass

    assert _satisfies(swapped, _contract_params("reshape_and_cache")) is not None

    def no_window(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q
    ):
        pass

    assert "window" in _satisfies(no_window, _contract_params("paged_attention"))
