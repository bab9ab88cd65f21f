"""NATS authentication and TLS: the embedded server requires what the settings configure,
services and clients present it, and a client without it is refused. The example
deploy/nats.conf confines clients to the public subjects and their own inboxes."""

import asyncio
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nats
import pytest
from kvpager.services import credentials
from kvpager.services.connection import ConnectError, connect_options, flush_sent, open_connection
from kvpager.services.runtime import connect
from kvpager.services.serve.embedded import EmbeddedNats
from kvpager.services.settings import ServeSettings, Settings

from tests.nats_server import free_port
from tests.services.kvpager_cli import kvpager, start, wait_for_line

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {
    "KVPAGER_SERVICE_PASSWORD": "svc-secret",
    "KVPAGER_GATEWAY_PASSWORD": "gw-secret",
    "KVPAGER_CLIENT_PASSWORD": "cli-secret",
}
SERVICE_USER = {"nats_user": "kvpager-service", "nats_password": "svc-secret"}
CLIENT_USER = {
    "nats_user": "client",
    "nats_password": "cli-secret",
    "nats_inbox_prefix": "_INBOX_client",
}


@contextmanager
def embedded(settings: Settings, **options) -> Iterator[str]:
    server = EmbeddedNats(settings, ServeSettings(nats_port=free_port(), **options))
    try:
        server.start()
        yield server.url
    finally:
        server.stop()


async def _connect(url: str, **fields) -> None:
    nc = await open_connection(Settings(nats_url=url, **fields), "kvpager-test")
    await nc.close()


@pytest.mark.parametrize(
    "secret",
    [{"nats_token": "t0ken"}, {"nats_user": "ann", "nats_password": 'p "w" \\ {d}'}],
    ids=["token", "user-password"],
)
async def test_embedded_server_requires_credentials(secret):
    with embedded(Settings(**secret)) as url:
        await _connect(url, **secret)
        nc = await connect(Settings(nats_url=url, **secret), "test")  # as services connect
        await nc.close()
        with pytest.raises(ConnectError, match="authorization violation"):
            await _connect(url)
        wrong = {name: "wrong" for name in secret}
        with pytest.raises(ConnectError, match="authorization violation"):
            await _connect(url, **wrong)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    folder = tmp_path_factory.mktemp("certs")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_ext = ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign"]
    _openssl(folder, "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=kvpager test CA", *ca_ext)  # fmt: skip
    for name, ext in [
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        (folder / f"{name}.ext").write_text(ext + "\n")
        _openssl(folder, "req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}")  # fmt: skip
        _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey",
                 "ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                 "-extfile", f"{name}.ext")  # fmt: skip
    return folder


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


async def test_tls_with_a_ca(certs):
    server_tls = {"nats_server_cert": str(certs / "server.pem")}
    server_tls["nats_server_key"] = str(certs / "server.key")
    with embedded(Settings(), **server_tls) as url:
        assert url.startswith("tls://127.0.0.1:")
        await _connect(url, nats_tls_ca=str(certs / "ca.pem"))
        with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await _connect(url)  # the system's CAs do not know ours


async def test_mutual_tls_refuses_clients_without_a_certificate(certs):
    ca = str(certs / "ca.pem")
    client = {"nats_tls_ca": ca, "nats_tls_cert": str(certs / "client.pem")}
    client["nats_tls_key"] = str(certs / "client.key")
    server_tls = {"nats_server_cert": str(certs / "server.pem")}
    server_tls["nats_server_key"] = str(certs / "server.key")
    with embedded(Settings(**client), **server_tls) as url:
        await _connect(url, **client)
        with pytest.raises(ConnectError):
            await _connect(url, nats_tls_ca=ca)


async def test_example_config_confines_clients(monkeypatch):
    for name, value in PASSWORDS.items():
        monkeypatch.setenv(name, value)
    with embedded(Settings(), nats_config=str(ROOT / "deploy" / "nats.conf")) as url:
        service = await open_connection(Settings(nats_url=url, **SERVICE_USER), "service")
        violations: list[str] = []

        async def on_error(exc: Exception) -> None:  # the server's async -ERR lines
            violations.append(str(exc).lower())

        client_options = connect_options(Settings(nats_url=url, **CLIENT_USER))
        client = await nats.connect(url, error_cb=on_error, **client_options)
        internal = []

        async def answer(msg) -> None:
            await msg.respond(b"ok")

        async def record(msg) -> None:
            internal.append(msg)

        await service.subscribe("llm.health", cb=answer)
        await service.subscribe("llm.internal.>", cb=record)
        await flush_sent(service)  # the server has the subscriptions
        assert (await client.request("llm.health", b"", timeout=2)).data == b"ok"
        await client.subscribe("llm.internal.>")
        await client.publish("llm.internal.default.scheduler.requests", b"forged")
        await flush_sent(client)
        await flush_sent(service)
        for _ in range(100):  # -ERR comes asynchronously, maybe after the flush's PONG
            if len(violations) >= 2:
                break
            await asyncio.sleep(0.05)
        await client.close()
        await service.close()
        with pytest.raises(ConnectError, match="authorization violation"):
            await _connect(url)
    assert not internal
    found = "\n".join(violations)
    assert 'permissions violation for subscription to "llm.internal.>"' in found, found
    assert 'permissions violation for publish to "llm.internal.default' in found, found


def test_the_example_config_has_the_generated_permissions():
    """deploy/nats.conf (compose) and `kvpager serve`'s generated config: one scheme."""
    config = (ROOT / "deploy" / "nats.conf").read_text()
    for name, kind in (("service", "service"), ("gateway", "gateway"), ("client", "client")):
        generated = credentials.permissions(credentials.Identity(name, kind, "-"), "llm")
        assert f"{kind.upper()} = {generated}\n" in config, kind
    for user, role in (
        ("kvpager-service", "SERVICE"),
        ("gateway", "GATEWAY"),
        ("client", "CLIENT"),
    ):
        line = f"{{user: {user}, password: $KVPAGER_{role}_PASSWORD, permissions: ${role}}}"
        assert line in config, line


def test_serve_with_the_example_config(tiny_llama, tmp_path):
    """Services authenticate as "kvpager-service"; the client user streams; no credentials, no
    entry."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    service_env = {**PASSWORDS, "KVPAGER_NATS_USER": "kvpager-service"}
    service_env["KVPAGER_NATS_PASSWORD"] = PASSWORDS["KVPAGER_SERVICE_PASSWORD"]
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(port), "--no-http"]
    process = start(*args, "--nats-config", str(ROOT / "deploy" / "nats.conf"),
                    log_dir=tmp_path, env=service_env)  # fmt: skip
    try:
        wait_for_line(process, tmp_path / "out.txt", "kvpager: ready")
        client_env = {f"KVPAGER_{name.upper()}": value for name, value in CLIENT_USER.items()}
        done = kvpager("generate", "Hello", "--max-tokens", "4", "--nats-url", url, env=client_env)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        refused = kvpager("stats", "--nats-url", url)
        assert refused.returncode == 2 and "authorization violation" in refused.stderr
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def _user_nkey(folder: Path) -> tuple[Path, str]:
    """A fresh user nkey: its seed file (what a service reads) and its public key."""
    import nkeys

    folder.mkdir(parents=True, exist_ok=True)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = folder / "user.nk"
    path.touch(mode=0o600)
    path.write_bytes(seed)
    return path, nkeys.from_seed(bytearray(seed)).public_key.decode()


async def test_nkey_authentication(tmp_path):
    """The server knows only a user's public key; whoever holds the seed signs its nonce."""
    seed_file, public_key = _user_nkey(tmp_path / "user")
    config = tmp_path / "nkey.conf"
    config.write_text(f'authorization {{ users = [ {{ nkey: "{public_key}" }} ] }}\n')
    nkey = {"nats_nkey": str(seed_file)}
    with embedded(Settings(**nkey), nats_config=str(config)) as url:
        await _connect(url, **nkey)
        nc = await connect(Settings(nats_url=url, **nkey), "test")  # as services connect
        await nc.close()
        with pytest.raises(ConnectError, match="authorization violation"):
            await _connect(url)
        stranger, _ = _user_nkey(tmp_path / "stranger")
        with pytest.raises(ConnectError, match="authorization violation"):
            await _connect(url, nats_nkey=str(stranger))
