"""The docs site builds without a warning, and the README keeps the commands CI runs.

`mkdocs build --strict` fails on a broken link, a page missing from the nav's files, or a
reference page whose generator (the CLI's parsers, the public JSON Schema) no longer runs.
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INSTALL = (
    'pip install torch==2.13.0 -e ".[test,nixl,dynamo]" && pip install --no-deps ai-dynamo==1.6.1'
)
TEST = "pytest -q"


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    # -P: the repository root must not stand in for the installed kvpager the hook imports
    result = subprocess.run(
        [sys.executable, "-P", "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "kvpager serve" in cli and "--kv-cache-dtype" in cli
    nats = (site / "reference" / "nats" / "index.html").read_text()
    assert "GenerateRequest" in nats and "abort_token" in nats


def test_readme_keeps_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = f"python3 -m venv .venv && . .venv/bin/activate && {INSTALL} && kvpager serve"
    assert install in readme and INSTALL in ci
    assert f". .venv/bin/activate && {TEST}" in readme and f"\n{TEST}\n" in ci
