"""How to reach NATS: `nats.connect` options for the settings' authentication and TLS.

Services and client commands connect with the same options, so one set of `KVPAGER_NATS_*`
variables (token, user/password, credentials file, nkey seed, CA and client certificate)
configures them all.
"""

import asyncio
import dataclasses
import ssl
import sys
from pathlib import Path
from typing import Any

import nats
import nats.errors
from kvpager.schemas.errors import ConfigError, KvpagerError
from kvpager.services import credentials
from kvpager.services.settings import Settings
from nats.aio.client import Client as NATS

CONNECT_TIMEOUT_S = 2.0


class ConnectError(KvpagerError):
    """No NATS server answers at the URL, or it refused us (auth, TLS)."""

    type = "unavailable"


def connect_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of `nats.connect` (beyond the URL) for auth and TLS."""
    _check_files(settings)
    options: dict[str, Any] = {}
    if settings.nats_token is not None:
        options["token"] = settings.nats_token
    if settings.nats_user is not None:
        options["user"] = settings.nats_user
        options["password"] = settings.nats_password
    if settings.nats_creds is not None:
        _require_nkeys()
        options["user_credentials"] = settings.nats_creds
    if settings.nats_nkey is not None:
        _require_nkeys()
        options["nkeys_seed"] = settings.nats_nkey
    if settings.nats_identity is not None:  # user, password and inbox prefix
        options.update(credentials.options_of(settings.nats_identity))
    if settings.nats_inbox_prefix is not None:  # permissions can then confine replies
        options["inbox_prefix"] = settings.nats_inbox_prefix
    context = tls_context(settings)
    if context is not None:
        options["tls"] = context
    return options


def _check_files(settings: Settings) -> None:
    files = ("nats_creds", "nats_nkey", "nats_identity", "nats_tls_ca", "nats_tls_cert")
    for name in (*files, "nats_tls_key"):
        path = getattr(settings, name)
        if path is not None and not Path(path).expanduser().is_file():
            raise ConfigError(f"{name}: {path} is not a file")


def _require_nkeys() -> None:
    try:
        import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
    except ImportError as exc:
        raise ConfigError("NATS credentials and nkey seeds need the nkeys package") from exc


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """A client TLS context when a CA, a client certificate or a tls:// URL asks for one."""
    wants_tls = settings.nats_tls_ca or settings.nats_tls_cert
    if not wants_tls and not any(url.startswith("tls://") for url in settings.nats_servers):
        return None
    try:
        context = ssl.create_default_context(cafile=settings.nats_tls_ca)
        if settings.nats_tls_cert is not None:
            context.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
    except OSError as exc:  # a missing file or a bad PEM (ssl.SSLError)
        raise ConfigError(f"NATS TLS files: {exc}") from exc
    return context


async def flush_sent(nc: NATS, timeout_s: float = 10.0) -> None:
    """Return once the server has processed everything sent on `nc` so far.

    `nc.flush()` alone does not promise that: nats-py (2.16) writes its PING straight to the
    socket, while a SUB or PUB sent just before may still wait in the buffer of its flusher
    task and reach the server after the PING. A SUB then has no effect yet when the PONG comes
    (measured: 0.8% of fresh subscriptions idle, 4% under load, answered "no responders" to
    a request right after the flush). The first round trip lets the flusher write the buffer;
    the second PING goes out behind it (0 of 4,000 under load).
    """
    for _ in range(2):
        await nc.flush(timeout=timeout_s)


def with_local_identity(settings: Settings, name: str = credentials.DEFAULT_CLIENT) -> Settings:
    """Settings without credentials get this host's identity `name` (the default client's),
    when a `kvpager serve` made one (its server refuses anonymous clients); else as given."""
    if settings.has_nats_auth:
        return settings
    path = credentials.local_client(name)
    return settings if path is None else dataclasses.replace(settings, nats_identity=str(path))


async def open_connection(settings: Settings, name: str) -> NATS:
    """Connect for a command: two quick tries, then a ConnectError that names the cause.

    Without credentials in the settings, the local default identity (`with_local_identity`).
    Services retry for ever instead (`services.runtime.connect`): they may start before NATS.
    """
    settings = with_local_identity(settings)
    errors = _ErrorReport()

    async def on_error(exc: Exception) -> None:  # nats-py wants a coroutine function
        errors.record(exc)

    connecting = nats.connect(
        settings.nats_servers,
        name=name,
        connect_timeout=CONNECT_TIMEOUT_S,
        allow_reconnect=False,  # an auth or TLS error is final; a refused connection...
        max_reconnect_attempts=1,  # ...is tried twice
        reconnect_time_wait=0.2,
        error_cb=on_error,
        **connect_options(settings),
    )
    try:  # the overall limit also covers a TLS handshake that never finishes
        return await asyncio.wait_for(connecting, 3 * CONNECT_TIMEOUT_S)
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        cause = errors.first or exc
        raise ConnectError(
            f"cannot connect to NATS at {settings.nats_url}: {_describe(cause)}"
        ) from exc
    finally:
        errors.connecting = False


class _ErrorReport:
    """nats-py's error callback: keep the first cause while connecting (a retry may only see
    the connection reset), print one line per error afterwards."""

    def __init__(self) -> None:
        self.first: BaseException | None = None
        self.connecting = True

    def record(self, exc: Exception) -> None:
        self.first = self.first or exc
        if not self.connecting:
            print(f"kvpager: NATS: {_describe(exc)}", file=sys.stderr)


def _describe(exc: BaseException) -> str:
    # nats-py raises AuthorizationError ("authorization failed") or passes the server's -ERR
    if any(
        words in str(exc).lower() for words in ("authorization violation", "authorization failed")
    ):
        return "authorization violation (check the token, user/password or credentials)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is a nats-server running there? try `kvpager serve`)"
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {3 * CONNECT_TIMEOUT_S:g} s"
    return str(exc) or type(exc).__name__
