"""Decode steps of the offline engine while another thread of the process has run one torch
copy (which starts an OpenMP team of that thread's own, kept as long as the thread lives):
the thread left as it is, or made serial first with kernels/openmp.py's `serial_here`.
bf16 SmolLM2, 4 prompts of ~1,200 tokens, 64 tokens each (graph_steps.py's decode steps).

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-openmp-teams/side_thread_team.py
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-07-xeon-amx-decode-graphs"))


def run(serial: bool) -> None:
    import graph_steps
    from kvpager.kernels import openmp

    torch.set_num_threads(2)

    def side() -> None:
        if serial:
            openmp.serial_here()
        source = torch.randn(1 << 22)
        torch.empty_like(source).copy_(source)  # one copy; then the thread only waits
        time.sleep(3600)

    threading.Thread(target=side, daemon=True).start()
    time.sleep(1)
    for round_ in range(2):
        steps, _, tokens = graph_steps.decode_steps("bfloat16", 4, 1200, False)
        kind = "serial side thread" if serial else "plain side thread "
        print(f"{kind} round {round_ + 1}: decode step median {steps[len(steps) // 2] * 1e3:.1f}"
              f" ms (n={len(steps)}); tokens {tokens[:12]}")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1] == "serial")
    else:  # each case in a fresh process: a team, once started, stays for the thread's life
        for case in ("plain", "serial", "plain", "serial"):
            subprocess.run([sys.executable, __file__, case], check=True)
