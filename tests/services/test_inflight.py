"""The in-flight journal (services/inflight.py): keys, entries a crash leaves open, compaction;
and the children of serve starting with nothing of the caller's folder importable."""

import os
import subprocess

import msgspec
import pytest
from kvpager.schemas.errors import PoisonedRequestError
from kvpager.services import inflight
from kvpager.services.inflight import Journal, journal_path, read_journal, request_key
from kvpager.services.serve.processes import python_module


def test_a_retried_request_has_the_key_of_the_first_try():
    first = b'{"prompt": "hi", "request_id": "a", "abort_token": "x", "max_tokens": 3}'
    retry = b'{ "max_tokens":3,"prompt":"hi","request_id":"b","timeout":9}'
    packed = msgspec.msgpack.encode({"prompt": "hi", "max_tokens": 3, "request_id": "c"})
    assert request_key(first) == request_key(retry) == request_key(packed, msgpack=True)
    assert request_key(first) != request_key(b'{"prompt": "hi", "max_tokens": 4}')
    assert request_key(b"[1, 2") == request_key(b"[1, 2")  # undecodable: keyed by its bytes
    assert request_key(b"[1, 2") != request_key(b"[1, 3")
    assert request_key(first, max_bytes=10) != request_key(retry, max_bytes=10)  # unread


def test_the_journal_leaves_open_what_was_open(tmp_path):
    journal = Journal(tmp_path)
    with journal.admitting("done"):
        journal.stream_opened("r1", "_INBOX.a.1", False)
        journal.stream_opened("r 2\n", "_INBOX.a.2", True)  # any request id is one line
    journal.stream_closed("r1")
    journal.stream_closed("never-opened")  # nothing written
    held = journal.admitting("open")
    held.__enter__()
    path = journal_path(tmp_path, os.getpid())
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    found = read_journal(path)
    assert found.suspects == ["open"]
    assert found.streams == {"r 2\n": ("_INBOX.a.2", True)}
    held.__exit__(None, None, None)
    with open(path, "ab") as torn:  # the crash cut the last line
        torn.write(b'["S", "r3", "_IN')
    assert read_journal(path).suspects == []
    assert read_journal(path).streams == {"r 2\n": ("_INBOX.a.2", True)}
    assert read_journal(tmp_path / "absent.journal").suspects == []


def test_a_long_journal_is_rewritten_with_its_open_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(inflight, "COMPACT_BYTES", 4096)
    journal = Journal(tmp_path)
    journal.stream_opened("kept", "_INBOX.k", False)
    for i in range(200):
        with journal.admitting(f"key-{i}"):
            journal.stream_opened(f"r{i}", f"_INBOX.{i}", False)
        journal.stream_closed(f"r{i}")
    path = journal_path(tmp_path, os.getpid())
    assert path.stat().st_size <= 4096 + 100
    assert read_journal(path).streams == {"kept": ("_INBOX.k", False)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_without_a_folder_nothing_is_written_nor_refused(tmp_path):
    journal = Journal(None)
    with journal.admitting("anything"):
        journal.stream_opened("r", "_INBOX.r", False)
    journal.stream_closed("r")
    (tmp_path / "poison").write_text("anything\n")
    with pytest.raises(PoisonedRequestError):
        with Journal(tmp_path).admitting("anything"):
            pass


def test_children_never_import_the_callers_folder(tmp_path):
    """A folder holding look-alikes of kvpager's packages and of a standard module."""
    marker = tmp_path / "ran"
    evil = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nraise SystemExit(7)\n"
    for package in ("services", "engine", "schemas", "kvpager"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(evil)
        (tmp_path / package / "cli.py").write_text(evil)
    for module in ("resource", "json", "typing"):
        (tmp_path / f"{module}.py").write_text(evil)
    argv = python_module("kvpager.services.cli", "--help")
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and not marker.exists()
