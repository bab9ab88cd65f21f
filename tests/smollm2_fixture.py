"""Session fixture `smollm2_path`: the real default model, downloaded and converted once.

Register it in tests/conftest.py (e.g. `from tests.smollm2_fixture import smollm2_path`).
"""

import os
from pathlib import Path

import pytest
from kvpager.engine.download import resolve_model

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted SmolLM2-135M-Instruct folder (float32 safetensors, ~540 MB).

    Uses `$KVPAGER_CACHE_DIR` when set, so CI can keep the conversion between runs; otherwise a
    cache in this session's pytest temp dir (a ~93 MB download and ~40 s of conversion).
    """
    # A fixed folder, not mktemp: a second registration of this fixture then hits the cache.
    default = tmp_path_factory.getbasetemp() / "kvpager-cache"
    cache = os.environ.get("KVPAGER_CACHE_DIR") or str(default)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPAGER_CACHE_DIR", cache)
        return resolve_model(SMOLLM2, progress=False)
