"""64-row bf16 decode steps (graph_steps.py: SmolLM2, prompts of 300-741 tokens, 64 tokens
each, decode graphs on) on a quiet host and beside a process that keeps ~20% of a core busy
(2 ms of spinning every 10 ms, as a served run's gateway, tokenizer and client take turns on a
2-core host). Run it at two commits to compare their kernels.

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-openmp-teams/steps_under_load.py
"""

import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-07-xeon-amx-decode-graphs"))
LOAD = """
import time
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < 0.002:
        pass
    time.sleep(0.008)
"""


def steps(label: str) -> None:
    import graph_steps

    measured, _, tokens = graph_steps.decode_steps("bfloat16", 64, 300, False)
    median, mean = measured[len(measured) // 2] * 1e3, sum(measured) / len(measured) * 1e3
    print(f"{label}: decode step median {median:.1f} ms, mean {mean:.1f}; tokens {tokens[:12]}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    for round_ in range(2):
        steps(f"quiet, round {round_ + 1}")
        load = subprocess.Popen([sys.executable, "-c", LOAD])
        time.sleep(0.5)
        try:
            steps(f"20% load, round {round_ + 1}")
        finally:
            load.kill()
