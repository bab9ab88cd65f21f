"""The engine's layout holds: the scheduler's side loads without torch in a fresh interpreter,
no folder is crowded, and no function outside a Triton kernel body runs past 50 lines."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER_SIDE = (
    "kvpager.engine.sched.scheduler",
    "kvpager.engine.kv.block_manager",
    "kvpager.engine.kv.kv_size",
    "kvpager.engine.router.routing",
    "kvpager.engine.core",
)
MAX_MODULES_PER_FOLDER = 15
MAX_FUNCTION_LINES = 50


def test_the_scheduler_side_imports_no_torch():
    heavy = "('torch', 'transformers', 'kvpager.engine.worker', 'kvpager.engine.model')"
    code = f"import sys; import {', '.join(SCHEDULER_SIDE)}; "
    code += "print(' '.join(m for m in sys.modules if (m + '.').startswith(tuple(h + '.' "
    code += f"for h in {heavy}))))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], result.stdout


def test_no_engine_folder_holds_more_than_15_modules():
    for folder in [ROOT / "engine", *(p for p in (ROOT / "engine").iterdir() if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= MAX_MODULES_PER_FOLDER, (folder, len(modules))


def _is_triton_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def test_no_function_runs_past_50_lines():
    long = []
    for package in ("engine", "kernels", "schemas", "services"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES and not _is_triton_kernel(node):
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert not long, long
