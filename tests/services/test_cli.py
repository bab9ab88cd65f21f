"""Bad set-up gets one clear line and a non-zero exit, never a traceback.

Most cases call `services.cli.main` in-process (they fail before any child starts); the ones
that need real services to find the problem run `kvpager serve` as a subprocess.
"""

import shutil
import socket

import pytest
from kvpager.services.cli import main

from tests.nats_server import free_port
from tests.services.kvpager_cli import kvpager, processes_on

pytestmark = pytest.mark.usefixtures("restore_logging")


def _fails(capsys, *argv: str) -> str:
    """Run `kvpager <argv>`; it must exit 2 with one `kvpager: ...` line on stderr."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("kvpager: ") and err.count("\n") == 1, err
    return err


def test_model_path_that_does_not_exist(capsys, tmp_path):
    err = _fails(capsys, "serve", "--no-http", "--model", str(tmp_path / "missing"))
    assert "does not exist and is not a known model name" in err


def test_model_folder_that_is_not_a_checkpoint(capsys, tmp_path, tiny_llama):
    assert "has no config.json" in _fails(capsys, "serve", "--no-http", "--model", str(tmp_path))
    shutil.copy(tiny_llama / "config.json", tmp_path)
    assert "no *.safetensors weights" in _fails(
        capsys, "serve", "--no-http", "--model", str(tmp_path)
    )


def test_nats_url_that_does_not_answer(capsys, tiny_llama):
    url = f"nats://127.0.0.1:{free_port()}"
    err = _fails(capsys, "serve", "--no-http", "--model", str(tiny_llama), "--nats-url", url)
    assert f"cannot connect to NATS at {url}: connection refused" in err
    assert "cannot connect to NATS" in _fails(capsys, "generate", "hi", "--nats-url", url)


@pytest.mark.parametrize("name", ["nats_tls_ca", "nats_creds", "nats_nkey"])
def test_nats_files_that_do_not_exist(capsys, tmp_path, name):
    flag = "--" + name.replace("_", "-")
    err = _fails(capsys, "stats", flag, str(tmp_path / "missing"))
    assert f"{name}: {tmp_path / 'missing'} is not a file" in err


def test_nats_server_without_kvpager(capsys, nats_server):
    err = _fails(capsys, "generate", "hi", "--nats-url", nats_server.url)
    assert "no kvpager listens on 'llm.generate'" in err


def test_port_in_use(capsys, tiny_llama):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _fails(
            capsys, "serve", "--no-http", "--model", str(tiny_llama), "--nats-port", str(port)
        )
    assert f"port {port} on 127.0.0.1 is in use" in err and "--nats-port" in err


def test_cache_too_small_for_one_request(capsys, tiny_llama):
    err = _fails(capsys, "serve", "--no-http", "--model", str(tiny_llama), "--num-blocks", "1")
    assert "(1 blocks of 16 tokens) cannot hold one request of max_model_len 1024" in err


def test_bad_environment_value(capsys, monkeypatch):
    monkeypatch.setenv("KVPAGER_NUM_BLOCKS", "many")
    assert "KVPAGER_NUM_BLOCKS: 'many' is not a valid int" in _fails(capsys, "serve")


@pytest.mark.parametrize(
    "flags, messages",
    [
        # the executor allocates 2 blocks (32 tokens): found once it has attached
        (["--kv-cache-memory", "16384"], ["cannot hold one request of max_model_len 1024"]),
        # the executor exits at start-up, saying why; the launcher stops the rest
        (
            ["--dtype", "float8"],
            ["kvpager: dtype: unknown dtype 'float8'", "the executor exited with code 2"],
        ),
    ],
)
def test_failure_found_by_the_services(tiny_llama, flags, messages):
    url = f"nats://127.0.0.1:{free_port()}"
    args = ["serve", "--no-http", "--model", str(tiny_llama), "--nats-port", url.rsplit(":", 1)[1]]
    done = kvpager(*args, *flags, timeout=120)
    assert done.returncode == 2, done.stderr
    assert all(m in done.stderr for m in messages), done.stderr
    assert "Traceback" not in done.stderr
    assert "kvpager: ready" not in done.stdout
    assert not processes_on(url)


def test_kv_cache_dtype_flag(capsys, tiny_llama):
    """`--kv-cache-dtype` takes vLLM's fp8 names, in `kvpager offline` as in serve; an unknown
    one is one line naming the accepted values, before anything starts."""
    args = ["offline", "Hello", "--model", str(tiny_llama), "--max-tokens", "4"]
    assert main([*args, "--kv-cache-dtype", "fp8"]) == 0
    assert capsys.readouterr().out.strip()
    err = _fails(
        capsys, "serve", "--no-http", "--model", str(tiny_llama), "--kv-cache-dtype", "fp4"
    )
    assert "kv_cache_dtype: unknown dtype 'fp4'" in err and "'fp8_e5m2'" in err
