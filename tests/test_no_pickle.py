"""Weights are safetensors and messages msgspec: no pickle-capable loader anywhere in the source."""

import ast
from pathlib import Path

SOURCE_DIRS = ("engine", "kernels", "schemas", "services")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}
UNSAFE_MODULES |= {"marshal", "torch.serialization", "torch.package"}
UNSAFE_CALLS = {"torch.load", "torch.jit.load", "np.load", "numpy.load", "pd.read_pickle"}
UNSAFE_KEYWORDS = {("allow_pickle", True), ("weights_only", False), ("trust_remote_code", True)}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _unsafe(node: ast.AST) -> str | None:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.Call):
        keywords = {(k.arg, getattr(k.value, "value", None)) for k in node.keywords}
        strings = {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
        if _dotted(node.func) in UNSAFE_CALLS or keywords & UNSAFE_KEYWORDS:
            return ast.unparse(node)
        names = (
            list(strings) if _dotted(node.func).endswith(("import_module", "__import__")) else []
        )
    else:
        return None
    bad = [name for name in names if name in UNSAFE_MODULES or name in UNSAFE_CALLS]
    return ", ".join(bad) or None


def test_nothing_is_unpickled():
    """Weights are safetensors, messages msgspec: no pickle-capable loader anywhere."""
    root = Path(__file__).parents[1]
    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            found += [
                f"{path.relative_to(root)}:{node.lineno}: {what}"
                for node in ast.walk(tree)
                if (what := _unsafe(node))
            ]
    assert not found, "\n".join(found)
    assert _unsafe(ast.parse("torch.load(f)").body[0].value) == "torch.load(f)"
    assert _unsafe(ast.parse("from pickle import loads").body[0]) == "pickle"
