"""The A/B arm of this report: benchmarks/engine/spec_decode.py with verify steps run eagerly
(decode_graphs.MAX_ROW_TOKENS = 1: only one-token decode steps replay, as before 549c57b).
Run from the repository root:

    python benchmarks/reports/2026-12-07-zen4-verify-graphs/eager_verify.py \
        --methods suffix --workloads rewrite agent
"""

import runpy
import sys

from kvpager.engine.worker import decode_graphs

if __name__ == "__main__":
    sys.path.append(".")  # benchmarks/, after the installed kvpager
    decode_graphs.MAX_ROW_TOKENS = 1
    sys.argv[0] = "benchmarks.engine.spec_decode"
    runpy.run_module("benchmarks.engine.spec_decode", run_name="__main__")
