"""The fp8 paths of the Triton kernels, the chunked mask, the sinks and the latent attention
kernel (float32, bf16 and fp8 pages; the tiny models' rows and DeepSeek-V3's) compile for CUDA
(sm_90, PTX through the wheel's own ptxas) on a machine without a GPU: the interpreter the
other kernel tests run on executes Python, so it accepts what the compiler refuses (a kernel
reading a plain global compiled only in the interpreter until this test). The compile runs in
a child process, since TRITON_INTERPRET=1 (set for this session) turns every @triton.jit into
an interpreted one."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

BOTH = {"SINKS": True, "CHUNKED": True}  # gpt-oss's sinks beside Llama 4's chunks
# (kernel, cache pointer type, constexprs beyond the shared ones); query and out are bf16
ATTENTION_CASES = [
    ("*fp8e4nv", {"SPLIT": True, "SOFTCAP": True, "WINDOW": True, "BLOCK_Q": 4}),
    ("*fp8e5", {"SPLIT": False, "SOFTCAP": True, "WINDOW": True, "BLOCK_Q": 16}),
    ("*bf16", {"SPLIT": False, "SOFTCAP": True, "WINDOW": False, "BLOCK_Q": 16}),
    ("*bf16", {"SPLIT": True, "SOFTCAP": False, "WINDOW": False, "BLOCK_Q": 16, "CHUNKED": True}),
    ("*bf16", {"SPLIT": False, "SOFTCAP": False, "WINDOW": True, "BLOCK_Q": 16, "SINKS": True}),
    ("*fp8e4nv", {"SPLIT": False, "SOFTCAP": False, "WINDOW": False, "BLOCK_Q": 4, **BOTH}),
]
# latent attention (kernels/mla_attention.py): (page pointer type, HALF, HALF_PAD, BLOCK_Q,
# BLOCK_H); DeepSeek-V3's row (512 + 64) is two halves of 288
MLA_CASES = [
    ("*fp32", 16, 16, 4, 4),
    ("*bf16", 16, 16, 1, 16),
    ("*fp8e4nv", 288, 512, 1, 16),
    ("*fp8e5", 288, 512, 1, 16),
]


def _compile_all() -> None:
    import triton
    from kvpager.kernels import kv_write, paged_attention_triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for mant, bias, largest in kv_write.FP8_FORMATS.values():
        fmt = dict(FP8=True, MANT=mant, BIAS=bias, MAX=largest)
        fmt.update(MIN_NORMAL=2.0 ** (1 - bias), INV_STEP=2.0 ** (bias - 1 + mant))
        const = dict(HEAD_DIM=64, ROW_SIZE=128, ROW_PAD=128, BLOCK_SIZE=16, **fmt)
        pointers = {"key_ptr": "*bf16", "value_ptr": "*bf16", "slot_mapping_ptr": "*i64"}
        pointers.update(key_cache_ptr="*u8", value_cache_ptr="*u8")
        _compile(triton, ASTSource, kv_write._reshape_and_cache_kernel, pointers, const, target)
    for cache, case in ATTENTION_CASES:
        const = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_N=64)
        const.update(BLOCK_SIZE=16, DOT_FP32=False, WIDEN_KV=cache != "*bf16", CHUNKED=False)
        const.update(SINKS=False)
        const.update(case)
        pointers = {"query_ptr": "*bf16", "out_ptr": "*bf16", "key_cache_ptr": cache}
        pointers.update(value_cache_ptr=cache, block_tables_ptr="*i32", seq_lens_ptr="*i32")
        pointers.update(cu_seqlens_q_ptr="*i32", partial_out_ptr="*fp32")
        pointers.update(partial_m_ptr="*fp32", partial_l_ptr="*fp32", sinks_ptr="*fp32")
        kernel = paged_attention_triton._paged_attention_kernel
        _compile(triton, ASTSource, kernel, pointers, const, target)
    _compile_mla(triton, ASTSource, target)


def _compile_mla(triton, source_cls, target) -> None:
    from kvpager.kernels import mla_attention

    for cache, half, half_pad, block_q, block_h in MLA_CASES:
        const = dict(BLOCK_Q=block_q, BLOCK_H=block_h, HALF=half, HALF_PAD=half_pad)
        const.update(BLOCK_N=mla_attention.BLOCK_N, BLOCK_SIZE=16)
        pointers = {"query_ptr": "*fp32", "out_ptr": "*fp32", "key_cache_ptr": cache}
        pointers.update(value_cache_ptr=cache, block_tables_ptr="*i32", seq_lens_ptr="*i32")
        pointers.update(cu_seqlens_q_ptr="*i32")
        kernel = mla_attention._mla_attention_kernel
        _compile(triton, source_cls, kernel, pointers, const, target)


def _compile(triton, source_cls, kernel, pointers, const, target) -> None:
    floats = {"k_scale", "v_scale", "qk_scale", "softcap"}
    signature = {
        name: pointers.get(name)
        or ("constexpr" if name in const else "fp32" if name in floats else "i32")
        for name in kernel.arg_names
    }
    compiled = triton.compile(source_cls(kernel, signature, const), target=target)
    assert compiled.asm["cubin"], kernel.__name__


def compile_in_child(path: str) -> None:
    """Runs `path` as a script without the interpreter (its __main__ compiles): it must pass."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_fp8_kernels_compile_for_cuda():
    compile_in_child(__file__)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
    _compile_all()
