"""NATS identities of a local kvpager: who may connect, and to which subjects.

`kvpager serve` turns nats-server's authorization on by default with users of three kinds,
each a file of its own (mode 0600, folder 0700) under the cache dir:

    <cache_dir>/nats/identities/service.json   the services (tokenizer, scheduler, executor,
                                               `kvpager serve` itself): everything
    <cache_dir>/nats/identities/gateway.json   the HTTP gateway and `kvpager metrics`: a
                                               client that also answers $SRV discovery
    <cache_dir>/nats/identities/default.json   `kvpager generate/stats/health` and the Python
                                               client; `kvpager credentials add NAME` adds more
    <cache_dir>/nats/auth.conf                 the nats-server authorization block, rebuilt
                                               from the identities whenever one is added
    <cache_dir>/nats/servers/<port>.pid        embedded servers running, reloaded on an add
    <cache_dir>/nats/kv-disk.key               the disk tier's HMAC key (engine/paths.py,
                                               created by the first executor with a disk tier)

A client identity publishes only the public subjects and subscribes only under its own
inbox prefix `_INBOX_<name>`: the server, not kvpager, refuses anything else, so no client
reads another's stream, nor llm.internal.>, nor joins a service's queue group.
"""

import json
import os
import re
import secrets
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpager.engine.paths import cache_dir
from kvpager.schemas.errors import ConfigError
from kvpager.services.subjects import Subjects, responses_bucket_subjects

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
SERVICE, GATEWAY, DEFAULT_CLIENT = "service", "gateway", "default"
KINDS = ("service", "gateway", "client")
SERVICE_USER_PREFIX = "kvpager-"  # a service identity's NATS user is kvpager-<name>
# The discovery subjects a gateway answers (nats.micro: $SRV.<verb>[.<name>[.<id>]]).
GATEWAY_SERVICES = ("kvpager-http", "kvpager-metrics")


@dataclass(frozen=True)
class Identity:
    """One NATS user: what `nats.connect` gets (user, password, inbox_prefix)."""

    name: str
    kind: str
    password: str

    @property
    def user(self) -> str:
        return SERVICE_USER_PREFIX + self.name if self.kind == "service" else self.name

    @property
    def inbox_prefix(self) -> str:
        return "_INBOX" if self.kind == "service" else f"_INBOX_{self.name}"

    def connect_options(self) -> dict[str, str]:
        return {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}

    def file_fields(self) -> dict[str, str]:
        """What its file holds: `nats.connect`'s user, password and inbox_prefix (what the
        README names), and the name and kind they derive from."""
        return {**asdict(self), **self.connect_options()}


def nats_dir() -> Path:
    return cache_dir() / "nats"


def identity_path(name: str, folder: Path | None = None) -> Path:
    return (folder or nats_dir()) / "identities" / f"{name}.json"


def load(path: str | Path) -> Identity:
    """An identity file; a ConfigError names what is wrong with it."""
    try:
        fields = json.loads(Path(path).expanduser().read_text())
        derived = {key: fields.pop(key) for key in ("user", "inbox_prefix") if key in fields}
        identity = Identity(**fields)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"NATS identity file {path}: {exc}") from exc
    if not NAME.match(identity.name) or identity.kind not in KINDS:
        raise ConfigError(f"NATS identity file {path}: bad name or kind")
    options = identity.connect_options()
    if any(options[key] != value for key, value in derived.items()):  # files before: without
        raise ConfigError(f"NATS identity file {path}: user or inbox_prefix do not match its name")
    return identity


def ensure(name: str, kind: str, folder: Path | None = None) -> Identity:
    """The identity `name`, created (random password, mode 0600) if it does not exist yet.

    Created with O_EXCL, so two `kvpager serve` starting at once agree on one password."""
    if not NAME.match(name):
        raise ConfigError(f"identity name {name!r}: letters, digits and '-', at most 64")
    path = identity_path(name, folder)
    _private_dir(path.parent.parent)  # nats/: auth.conf holds every password
    _private_dir(path.parent)
    identity = Identity(name, kind, secrets.token_urlsafe(24))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load(path)
    with os.fdopen(fd, "w") as file:
        json.dump(identity.file_fields(), file)
    return identity


def identities(folder: Path | None = None) -> list[Identity]:
    found = sorted((folder or nats_dir()).glob("identities/*.json"))
    return [load(path) for path in found if not path.name.startswith(".")]


def local_client(name: str = DEFAULT_CLIENT) -> Path | None:
    """The identity file a client on this host uses when given no credentials, if any."""
    path = identity_path(name)
    return path if path.is_file() else None


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)


def _quoted(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def permissions(identity: Identity, prefix: str) -> str:
    """nats-server permissions of one identity (config syntax)."""
    if identity.kind == "service":
        # trusted: they answer on clients' inboxes (whatever their prefix) and on their own
        subscribe = [f"{prefix}.>", "$SRV.>", "_INBOX.>"]
        return f'{{publish: [">"], subscribe: {_quoted(subscribe)}}}'
    public = Subjects(prefix)
    publish = [public.generate, public.abort, public.health, public.models, public.stats]
    publish += [public.tokenize, public.detokenize]
    subscribe = [f"{identity.inbox_prefix}.>"]
    if identity.kind == "client":
        return f"{{publish: {_quoted(publish)}, subscribe: {_quoted(subscribe)}}}"
    publish += responses_bucket_subjects(prefix)  # --responses-store nats, its bucket alone
    for service in GATEWAY_SERVICES:  # $SRV.PING etc. and the ones naming the gateway
        subscribe += [f"$SRV.*.{service}", f"$SRV.*.{service}.>"]
    subscribe += ["$SRV.PING", "$SRV.INFO", "$SRV.STATS"]
    # allow_responses: it may answer the $SRV requests it receives, and publish nothing else
    allow = 'allow_responses: {max: 1, expires: "1m"}'
    return f"{{publish: {_quoted(publish)}, subscribe: {_quoted(subscribe)}, {allow}}}"


def render_config(users: list[Identity], prefix: str) -> str:
    lines = [
        "# Written by kvpager (services/credentials.py) from identities/; rebuilt by",
        "# `kvpager serve` and `kvpager credentials add`: edits here are lost.",
        "authorization {",
        "  users = [",
    ]
    for identity in users:
        user, password = json.dumps(identity.user), json.dumps(identity.password)
        perms = permissions(identity, prefix)
        lines.append(f"    {{user: {user}, password: {password}, permissions: {perms}}}")
    return "\n".join([*lines, "  ]", "}", ""])


def write_config(prefix: str, folder: Path | None = None) -> Path:
    """Rebuild auth.conf (0600) from the identities, atomically (a reload reads it whole)."""
    folder = folder or nats_dir()
    path = folder / "auth.conf"
    temporary = folder / f".auth.conf.{os.getpid()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(render_config(identities(folder), prefix))
    temporary.replace(path)
    return path


def prepare_server(prefix: str, folder: Path | None = None) -> Path:
    """What an embedded server needs: the three standard identities and auth.conf."""
    for name, kind in ((SERVICE, "service"), (GATEWAY, "gateway"), (DEFAULT_CLIENT, "client")):
        ensure(name, kind, folder)
    return write_config(prefix, folder)


def add_client(name: str, prefix: str, folder: Path | None = None) -> tuple[Path, bool]:
    """A new client identity; auth.conf rebuilt. (its file, whether it existed already)"""
    _check_client_name(name, folder)
    existed = identity_path(name, folder).exists()
    ensure(name, "client", folder)
    write_config(prefix, folder)
    return identity_path(name, folder), existed


def _check_client_name(name: str, folder: Path | None) -> None:
    """Refuse a name whose NATS user another identity holds or may hold: nats-server refuses
    a config naming one user twice, so every later (re)load would fail."""
    if name in (SERVICE, GATEWAY) or name.lower().startswith(SERVICE_USER_PREFIX):
        raise ConfigError(
            f"identity name {name!r} is reserved: {SERVICE!r}, {GATEWAY!r} and names starting "
            f"with {SERVICE_USER_PREFIX!r} belong to kvpager's own services"
        )
    if not NAME.match(name):
        raise ConfigError(f"identity name {name!r}: letters, digits and '-', at most 64")
    taken = {identity.user: identity.name for identity in identities(folder)}
    if taken.get(name, name) != name:
        raise ConfigError(f"identity name {name!r}: NATS user {name!r} is taken by {taken[name]!r}")


def pid_file(port: int, folder: Path | None = None) -> Path:
    path = (folder or nats_dir()) / "servers" / f"{port}.pid"
    _private_dir(path.parent)
    return path


def reload_servers(folder: Path | None = None) -> list[int]:
    """SIGHUP (nats-server's config reload) every embedded server of this cache dir that
    still runs; a stale pid file, or one whose pid now names another program, is removed."""
    reloaded = []
    for path in sorted((folder or nats_dir()).glob("servers/*.pid")):
        pid = _server_pid(path)
        if pid is None:
            path.unlink(missing_ok=True)
            continue
        os.kill(pid, signal.SIGHUP)
        reloaded.append(pid)
    return reloaded


def _server_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"nats-server" in cmdline.split(b"\0")[0] else None


def options_of(path: str) -> dict[str, str]:
    """`nats.connect` options of an identity file."""
    return load(path).connect_options()
