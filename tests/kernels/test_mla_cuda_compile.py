"""The latent attention kernel (kernels/mla_attention.py) compiles for CUDA (sm_90, PTX through
the wheel's own ptxas) on a machine without a GPU, over float32, bf16 and both fp8 pages, at
the tiny models' row and at DeepSeek-V3's (512 + 64: halves of 288); in a child process, as
tests/kernels/test_cuda_compile.py does (TRITON_INTERPRET=1 is set for this session)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

# (page pointer type, HALF, HALF_PAD, BLOCK_Q, BLOCK_H)
CASES = [
    ("*fp32", 16, 16, 4, 4),
    ("*bf16", 16, 16, 1, 16),
    ("*fp8e4nv", 288, 512, 1, 16),
    ("*fp8e5", 288, 512, 1, 16),
]


def _compile_all() -> None:
    import triton
    from kvpager.kernels import mla_attention
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels.test_cuda_compile import _compile

    for cache, half, half_pad, block_q, block_h in CASES:
        const = dict(BLOCK_Q=block_q, BLOCK_H=block_h, HALF=half, HALF_PAD=half_pad)
        const.update(BLOCK_N=mla_attention.BLOCK_N, BLOCK_SIZE=16)
        pointers = {"query_ptr": "*fp32", "out_ptr": "*fp32", "key_cache_ptr": cache}
        pointers.update(value_cache_ptr=cache, block_tables_ptr="*i32", seq_lens_ptr="*i32")
        pointers.update(cu_seqlens_q_ptr="*i32")
        kernel = mla_attention._mla_attention_kernel
        _compile(triton, ASTSource, kernel, pointers, const, GPUTarget("cuda", 90, 32))


def test_latent_attention_compiles_for_cuda():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
    _compile_all()
