"""The local NATS identities: files, the server config they make, reloads, the opt-out."""

import asyncio
import json
import stat
import subprocess
import time

import nats
import pytest
from kvpager.schemas.public import TokenizeRequest
from kvpager.services import credentials
from kvpager.services.client import Client, NoKvpagerError
from kvpager.services.connection import ConnectError, open_connection
from kvpager.services.serve.embedded import EmbeddedNats
from kvpager.services.serve.launcher import _start_server
from kvpager.services.settings import ServeSettings, Settings
from kvpager.services.subjects import is_inbox

from tests.nats_server import free_port, nats_server_binary
from tests.services.conftest import start_services
from tests.services.kvpager_cli import kvpager


@pytest.fixture
def nats_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPAGER_CACHE_DIR", str(tmp_path))
    return tmp_path / "nats"


def test_identities_are_private_and_kept(nats_dir):
    config = credentials.prepare_server("llm")
    first = credentials.load(credentials.identity_path("default"))
    credentials.prepare_server("llm")  # a second serve: the same passwords
    assert credentials.load(credentials.identity_path("default")) == first
    for path in [config, *nats_dir.glob("identities/*.json")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for folder in (nats_dir, nats_dir / "identities"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    names = sorted(identity.name for identity in credentials.identities())
    assert names == ["default", "gateway", "service"]
    assert first.inbox_prefix == "_INBOX_default" and len(first.password) >= 32
    keys = json.loads(credentials.identity_path("default").read_text())  # the README's keys
    assert {
        key: keys[key] for key in ("user", "password", "inbox_prefix")
    } == first.connect_options()


def test_the_config_is_valid_for_nats_server(nats_dir):
    credentials.prepare_server("llm")
    credentials.add_client("alice", "llm")
    config = (nats_dir / "auth.conf").read_text()
    assert '"_INBOX_alice.>"' in config and config.count("{user:") == 4
    checked = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(nats_dir / "auth.conf")],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stderr


def test_reserved_and_bad_names_are_refused(nats_dir):
    for name in ("service", "gateway", "a.b", "*", "", "-x"):
        with pytest.raises(credentials.ConfigError):
            credentials.add_client(name, "llm")


def test_service_users_are_refused_and_nothing_is_written(nats_dir):
    credentials.prepare_server("llm")
    before = {path: path.read_bytes() for path in nats_dir.rglob("*") if path.is_file()}
    for name in ("kvpager-service", "kvpager-gateway", "KVPAGER-service", "kvpager-x"):
        with pytest.raises(credentials.ConfigError, match="reserved"):
            credentials.add_client(name, "llm")
    after = {path: path.read_bytes() for path in nats_dir.rglob("*") if path.is_file()}
    assert after == before  # no identity file, auth.conf untouched
    done = kvpager("credentials", "add", "kvpager-service")
    assert done.returncode != 0 and "reserved" in done.stderr, (done.stdout, done.stderr)
    assert not credentials.identity_path("kvpager-service").exists()
    checked = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(nats_dir / "auth.conf")],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stderr


def test_inbox_subjects():
    for subject in ("_INBOX.abc", "_INBOX_alice.abc.def", "_INBOX.x.*x"):
        assert is_inbox(subject), subject
    for subject in (None, "", "_INBOX", "_INBOX.", "_INBOX.a..b", "_INBOX.>", "_INBOX_a.*",
                    "llm.internal.default.scheduler.attach", "$SRV.PING", "llm.abort",
                    "_INBOXES.a", "x._INBOX.a"):  # fmt: skip
        assert not is_inbox(subject or ""), subject


async def _connect_soon(settings: Settings, name: str, within_s: float = 10.0):
    """The server reloads its config on SIGHUP asynchronously: a connection made the moment
    `credentials add` returns may still meet the old user list."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await open_connection(settings, name)
        except ConnectError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_credentials_add_reloads_a_running_server(nats_dir):
    server = EmbeddedNats(Settings(), ServeSettings(nats_port=free_port()))
    server.start()
    try:
        assert (nats_dir / "servers" / f"{server.port}.pid").is_file()
        done = kvpager("credentials", "add", "bob")
        assert done.returncode == 0, done.stderr
        assert f"pid {server.process.pid}" in done.stdout and "0600" in done.stdout
        bob = Settings(nats_url=server.url, nats_identity=str(credentials.identity_path("bob")))
        nc = await _connect_soon(bob, "bob")  # accepted without a restart, once reloaded
        await nc.close()
    finally:
        server.stop()
    assert not (nats_dir / "servers" / f"{server.port}.pid").exists()
    done = kvpager("credentials", "add", "carol")
    assert "the next `kvpager serve` accepts it" in done.stdout


async def test_anonymous_clients_are_refused_unless_insecure(nats_dir, capsys):
    settings = Settings()
    secure = EmbeddedNats(settings, ServeSettings(nats_port=free_port()))
    insecure = EmbeddedNats(settings, ServeSettings(nats_port=free_port(), nats_insecure=True))
    try:
        services, gateway = _start_server(secure, settings, ServeSettings())
        assert services.nats_identity.endswith("service.json")
        assert gateway.nats_identity.endswith("gateway.json")
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(secure.url, allow_reconnect=False, connect_timeout=2)
        assert "WARNING" not in capsys.readouterr().err
        services, _ = _start_server(insecure, settings, insecure.options)
        assert services.nats_identity is None
        assert "WARNING: --nats-insecure" in capsys.readouterr().err
        nc = await asyncio.wait_for(nats.connect(insecure.url, allow_reconnect=False), 5)
        await nc.close()
    finally:
        secure.stop()
        insecure.stop()


async def test_a_client_identity_may_tokenize_and_detokenize(nats_dir, tiny_llama, tmp_path):
    """llm.tokenize and llm.detokenize are public subjects: the server lets a client send them."""
    server = EmbeddedNats(Settings(), ServeSettings(nats_port=free_port()))
    server.start()
    services = None
    try:
        service_env = {"KVPAGER_NATS_IDENTITY": server.identity("service")}
        services = start_services(
            server.url, tiny_llama, tmp_path, names=("tokenizer",), **service_env
        )
        default = str(credentials.identity_path("default"))
        client = Client(
            await _connect_soon(Settings(nats_url=server.url, nats_identity=default), "c"), "llm"
        )
        tokens = await _answered(lambda: client.tokenize(TokenizeRequest(prompt="Hello world")))
        assert tokens.error is None and tokens.token_ids, tokens
        text = await client.detokenize(tokens.token_ids)
        assert text.error is None and text.text == "Hello world", text
        await client.nc.close()
    finally:
        if services is not None:
            services.stop()
        server.stop()


async def _answered(query, timeout_s: float = 120.0):
    """`query()` once the tokenizer has subscribed (no responders until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await query()
        except (NoKvpagerError, TimeoutError, nats.errors.Error):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
