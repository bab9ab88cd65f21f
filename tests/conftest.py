"""Test-wide set-up: Triton runs in its interpreter without CUDA; tiny seeded checkpoints."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.models import build_llama, build_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


pytest_plugins = ["tests.smollm2_fixture"]
