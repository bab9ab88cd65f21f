"""What a service is doing right now, written where `kvpager serve` can read it after a crash.

Each child of `kvpager serve` appends to `<journal_dir>/<pid>.journal`, one JSON array a line:

    ["+", key, n]                     admitting a request (decoding, validating, grammar
    ["-", n]                          compiling, templating): the risky phase, then its end
    ["S", request_id, reply, msgpack] a stream this process owns (its final event is ours)
    ["E", request_id]                 that stream ended

No fsync: a crashed process's writes are in the page cache already. When a child dies the
supervisor reads its journal (`read_journal`): the admissions left open are the suspects (a
request that crashes a service is blamed, not the deployment), the streams left open get a
final event from serve. A key struck twice goes to `<journal_dir>/poison`, which every front
door checks before admitting (`Journal.admitting`).

A key is the sha256 of the request with the fields a client changes on every try left out
(`request_id`, `abort_token`, `timeout`, `deadline`, `user`), keys sorted: a retried
request has the key of the request that crashed the service.
"""

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
from kvpager.schemas.errors import PoisonedRequestError

log = structlog.get_logger(__name__)

POISON_FILE = "poison"
VOLATILE_FIELDS = ("request_id", "abort_token", "timeout", "deadline", "user")
COMPACT_BYTES = 1 << 20  # past this, the journal is rewritten with its open entries only


def request_key(body: bytes, msgpack: bool = False, max_bytes: int = 1 << 24) -> str:
    """The key of a request's body (JSON or msgpack); a body that does not decode to an object,
    or is over `max_bytes`, is keyed by its bytes."""
    fields = None
    if len(body) <= max_bytes:
        try:
            fields = (msgspec.msgpack if msgpack else msgspec.json).decode(body)
        except (msgspec.DecodeError, ValueError, RecursionError):
            fields = None
    if not isinstance(fields, dict):
        return hashlib.sha256(body).hexdigest()
    for name in VOLATILE_FIELDS:
        fields.pop(name, None)
    return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()


def journal_path(folder: str | Path, pid: int) -> Path:
    return Path(folder) / f"{pid}.journal"


class Journal:
    """One process's journal and its view of the poison list; `Journal(None)` records nothing
    and refuses nothing (a service started without `kvpager serve`)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = None if folder is None else Path(folder)
        self._fd: int | None = None
        self._admitting: dict[int, str] = {}  # entry number -> key
        self._streams: dict[str, tuple[str, bool]] = {}  # request id -> (reply, msgpack)
        self._next = 0
        self._poison = _PoisonList(None if self.folder is None else self.folder / POISON_FILE)

    @contextlib.contextmanager
    def admitting(self, key: str) -> Iterator[None]:
        """The block admits the request keyed `key`. PoisonedRequestError if it is refused."""
        self._poison.check(key)
        if self.folder is None:
            yield
            return
        number, self._next = self._next, self._next + 1
        self._admitting[number] = key
        self._write(["+", key, number])
        try:
            yield
        finally:
            del self._admitting[number]
            self._write(["-", number])

    def stream_opened(self, request_id: str, reply_to: str, msgpack: bool) -> None:
        if self.folder is not None:
            self._streams[request_id] = (reply_to, msgpack)
            self._write(["S", request_id, reply_to, msgpack])

    def stream_closed(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._write(["E", request_id])

    def _write(self, entry: list) -> None:
        if self._fd is None:
            path = journal_path(self.folder, os.getpid())
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(self._fd, msgspec.json.encode(entry) + b"\n")
        if os.fstat(self._fd).st_size > COMPACT_BYTES:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the journal with the entries still open (atomically: a rename)."""
        path = journal_path(self.folder, os.getpid())
        entries = [["+", key, n] for n, key in self._admitting.items()]
        entries += [["S", rid, reply, mp] for rid, (reply, mp) in self._streams.items()]
        fresh = path.with_suffix(".compacting")
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"".join(msgspec.json.encode(e) + b"\n" for e in entries))
        os.replace(fresh, path)
        os.close(self._fd)
        self._fd = fd


@dataclass
class _PoisonList:
    """The supervisor's list of refused keys, read again whenever the file changes."""

    path: Path | None
    keys: frozenset[str] = frozenset()
    _seen: tuple[int, int] | None = field(default=None, repr=False)  # (mtime_ns, size)

    def check(self, key: str) -> None:
        if self.path is None:
            return
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            self._seen = (stat.st_mtime_ns, stat.st_size)
            self.keys = frozenset(self.path.read_text().split())
        if key in self.keys:
            raise PoisonedRequestError(
                "this request crashed a kvpager service twice and is refused until the "
                "deployment restarts"
            )


@dataclass
class OpenEntries:
    """What a dead process's journal left open."""

    suspects: list[str] = field(default_factory=list)  # keys being admitted
    streams: dict[str, tuple[str, bool]] = field(default_factory=dict)  # id -> reply, msgpack


def read_journal(path: Path) -> OpenEntries:
    """The open entries of a journal; a torn last line (the crash cut it) is skipped."""
    admitting: dict[int, str] = {}
    found = OpenEntries()
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return found
    for line in lines:
        try:
            entry = msgspec.json.decode(line)
        except msgspec.DecodeError:
            continue
        _apply(entry, admitting, found.streams)
    found.suspects = list(admitting.values())
    return found


def _apply(entry: list, admitting: dict[int, str], streams: dict[str, tuple[str, bool]]) -> None:
    match entry:
        case ["+", str(key), int(number)]:
            admitting[number] = key
        case ["-", int(number)]:
            admitting.pop(number, None)
        case ["S", str(request_id), str(reply), bool(msgpack)]:
            streams[request_id] = (reply, msgpack)
        case ["E", str(request_id)]:
            streams.pop(request_id, None)
