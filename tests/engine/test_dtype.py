"""`dtype="auto"`: the checkpoint's dtype, unless the CPU would run it slowly or not at all."""

from types import SimpleNamespace

import pytest
import torch
from kvpager.engine import memory
from kvpager.engine.memory import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "checkpoint,device,native_bf16,expected",
    [
        ("float32", CPU, False, torch.float32),
        ("float16", CPU, True, torch.float32),
        ("bfloat16", CPU, False, torch.float32),
        ("bfloat16", CPU, True, torch.bfloat16),
        ("bfloat16", CUDA, False, torch.bfloat16),
        ("float16", CUDA, False, torch.float16),
    ],
)
def test_auto_dtype(monkeypatch, checkpoint, device, native_bf16, expected):
    monkeypatch.setattr(memory, "cpu_has_native_bf16", lambda: native_bf16)
    model_config = SimpleNamespace(checkpoint_dtype=checkpoint)
    assert resolve_dtype("auto", model_config, device) == expected
    assert resolve_dtype("bfloat16", model_config, device) == torch.bfloat16  # asked for
