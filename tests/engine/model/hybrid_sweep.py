"""A sweep of the recurrent hybrids (granitemoehybrid, nemotron_h, qwen3_next, qwen3_5) over
configs drawn unlike the tests' own: for each, greedy-equal to transformers roomy, under
recompute preemption with small prefill chunks, and a repeated 64-token prompt served from a
state snapshot; every block and state slot free after each run. A script, not a test (it
takes minutes): `python -m tests.engine.model.hybrid_sweep [name-substring ...]`. The
regression test module (test_hybrid_variants.py) keeps a handful of its configs."""

import sys
import tempfile
import time
import traceback
from pathlib import Path

# as tests/conftest.py: the repository root goes last, so that its kernels/ folder does not
# stand in for Hugging Face's `kernels`, which transformers imports
ROOT = Path(__file__).resolve().parents[3]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]

from tests.engine.helpers import make_llm  # noqa: E402
from tests.engine.model import hybrid_checks as checks  # noqa: E402
from tests.engine.model.hybrid_variants import SWEEP, SWEEP_PROMPTS  # noqa: E402
from tests.engine.model.test_parity import MAX_TOKENS  # noqa: E402


def run_one(name: str, build, root: Path) -> str:
    path = build(root / name)
    expected = SWEEP[name].hf_greedy(path, SWEEP_PROMPTS, MAX_TOKENS)
    checks.check_roomy(path, SWEEP_PROMPTS, expected)
    checks.check_recompute(path, SWEEP_PROMPTS, expected, num_blocks=10, chunk=5, seqs=4)
    SWEEP[name].check_repeated(path)
    checks.check_parallel_samples(path, SWEEP_PROMPTS[3], expected[3])
    with make_llm(path, attention_backend="cpu", max_num_batched_tokens=7) as llm:
        assert checks.greedy(llm, SWEEP_PROMPTS) == expected, "C kernels"
        checks.assert_slots_free(llm)
    return "ok"


def main(patterns: list[str]) -> int:
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant in SWEEP.items():
            if patterns and not any(p in name for p in patterns):
                continue
            start = time.perf_counter()
            try:
                result = run_one(name, variant.build, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - a sweep reports every config
                failed += 1
                result = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc(limit=-3)
            print(f"{name:40s} {time.perf_counter() - start:6.1f}s {result}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
