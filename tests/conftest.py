"""Test-wide set-up: Triton runs in its interpreter without CUDA; tiny seeded checkpoints."""

import os
import sys
from pathlib import Path

import pytest
import torch

# The tests' own helpers (`tests.models`, ...) import from the repository root, which goes last
# on sys.path (`python -m pytest` puts it first): there, its folders would stand in for installed
# packages of the same name (transformers imports Hugging Face's `kernels`). kvpager itself comes
# from the install, as `kvpager.*`.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]

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
