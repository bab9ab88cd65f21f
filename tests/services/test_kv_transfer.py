"""KV blocks between two executors' caches in two processes, over NIXL (when installed) and
the NATS fallback: the cards go over NATS, the reader pulls, the bytes are equal in every KV
group (Gemma 2: a sliding and a full group) with an fp8 cache, and the holder hears that its
blocks were read. A holder killed before the pull, or blocks out of range, end the pull with
a typed error instead (the scheduler then recomputes: tests/engine/sched/test_kv_handoff.py)."""

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kvpager.engine.worker.kv_transfer import nixl

from tests import model_families
from tests.nats_server import nats_server  # noqa: F401  (fixture)
from tests.services.kvpager_cli import QUIET_ENV

PEER_SCRIPT = Path(__file__).with_name("kv_peer.py")  # imports kvpager only
# Over NIXL a pull whose peer's card is still connecting waits for it (kv_endpoint's
# _wait_for_peer: NixlTransfer lists a peer only once connected); skipped without NIXL.
NIXL = pytest.param(
    "nixl", marks=pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed")
)
BACKENDS = ["nats", NIXL]
assert nixl.available() in (True, False)  # the module imports without NIXL too


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    return model_families.build_gemma2(tmp_path_factory.mktemp("gemma2"))


class Peer:
    def __init__(self, model, url: str, backend: str, instance: str, seed: int) -> None:
        argv = [
            sys.executable, "-P", str(PEER_SCRIPT), "--model", str(model),
            "--nats-url", url, "--instance", instance, "--backend", backend,
            "--kv-cache-dtype", "fp8", "--seed", str(seed), "--timeout", "5",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**__import__("os").environ, **QUIET_ENV},
        )  # fmt: skip
        ready = self.next("ready", timeout_lines=200)
        self.name, self.num_groups = ready["ready"], ready["groups"]

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def next(self, key: str, timeout_lines: int = 50) -> dict:
        for _ in range(timeout_lines):
            line = self.process.stdout.readline()
            assert line, f"the peer exited ({self.process.poll()})"
            if line.startswith("{") and key in (message := json.loads(line)):
                return message
        raise AssertionError(f"no {key!r} from the peer")

    def digest(self, blocks: list[int]) -> str:
        self.send({"digest": blocks})
        return self.next("digest")["digest"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def peers(tiny_gemma2, nats_server, request):  # noqa: F811
    backend = request.param
    made = [Peer(tiny_gemma2, nats_server.url, backend, f"i{i}", seed=i) for i in range(2)]
    yield made
    for peer in made:
        peer.close()


def _pull(reader: Peer, holder: Peer, remote, local) -> tuple[str, dict]:
    transfer_id = uuid.uuid4().hex
    reader.send({"pull": [transfer_id, holder.name, remote, local]})
    return transfer_id, reader.next("pulled")["pulled"]


@pytest.mark.parametrize("peers", BACKENDS, indirect=True)
def test_blocks_move_between_processes(peers):
    holder, reader = peers
    assert holder.num_groups == 2  # one table per group: a sliding one and a full one
    remote, local = [[3, 9], [17]], [[40, 41], [5]]
    assert holder.digest([3, 9, 17]) != reader.digest([40, 41, 5])  # seeded apart
    transfer_id, pulled = _pull(reader, holder, remote, local)
    assert pulled["transfer_id"] == transfer_id and pulled["error"] == "", pulled
    assert pulled["num_bytes"] > 0
    assert holder.next("sent")["sent"] == transfer_id  # the notification frees the blocks
    assert holder.digest([3, 9, 17]) == reader.digest([40, 41, 5])
    assert holder.digest([4]) != reader.digest([4])  # nothing else moved


@pytest.mark.parametrize("peers", BACKENDS, indirect=True)
def test_bad_blocks_are_a_typed_error(peers):
    holder, reader = peers
    _, pulled = _pull(reader, holder, [[3], [10**6]], [[1], [2]])
    assert "out of range" in pulled["error"], pulled
    _, pulled = _pull(reader, holder, [[3, 4]], [[1]])
    assert pulled["error"], pulled  # one group sent, two to receive; 2 blocks to 1


@pytest.mark.parametrize("peers", BACKENDS, indirect=True)
def test_holder_killed_is_a_typed_error(peers):
    holder, reader = peers
    holder.process.kill()
    holder.process.wait()
    _, pulled = _pull(reader, holder, [[1], [2]], [[7], [8]])
    assert pulled["error"], pulled  # failed: timed out or refused, never a hang
