"""Developer benchmarks by topic (peers, serving, engine, kernels, gpu), each run from the
repository root as `python -m benchmarks.<topic>.<name>`; `kvpager bench` is the installed one.

`python -m` puts the repository root first on sys.path, where its folders would stand in for
installed packages of the same name (transformers imports Hugging Face's `kernels`): it goes
last, as in tests/conftest.py, once, here. kvpager itself comes from the install.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]
