"""The layering contracts in pyproject.toml, checked by import-linter (`lint-imports`), and the
one import name: every package folder installs under kvpager, and no module imports a bare
`engine`, `kernels`, `schemas` or `services`."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "kernels", "schemas", "services")


def lint_view(folder: Path) -> Path:
    """kvpager as one folder tree (symlinks to the repository's folders), the shape import-linter
    reads: its graph walks a package's own folder, and setuptools' package-dir maps ours in from
    beside it."""
    package = folder / "kvpager"
    package.mkdir()
    (package / "__init__.py").symlink_to(ROOT / "kvpager" / "__init__.py")
    for name in FOLDERS:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    return folder


def test_import_contracts_are_kept(tmp_path):
    lint_imports = Path(sys.executable).with_name("lint-imports")
    view = lint_view(tmp_path)  # also the working folder: lint-imports puts it on sys.path
    result = subprocess.run(
        [str(lint_imports), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=view,
        env={"PYTHONPATH": str(view), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout, result.stdout


def test_every_package_folder_installs_under_kvpager():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        "kvpager." + ".".join(init.parent.relative_to(ROOT).parts)
        for name in FOLDERS
        for init in (ROOT / name).rglob("__init__.py")
    }
    assert folders | {"kvpager"} == listed
