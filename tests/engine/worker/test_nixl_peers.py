"""NixlTransfer's peers while a connect runs on a worker thread (as KvEndpoint runs it): the
peer is listed only once connected, so a pull that finds it listed finds its descriptors too
(the race behind "unknown KV transfer peer"), and the event loop's agent calls (notifications,
a transfer) never wait on the connect: they poll the lock and go on once it ends."""

import asyncio

import pytest
import torch
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.engine.worker.kv_transfer.regions import KvRegions

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed")


def _transfer(name: str, seed: int) -> nixl.NixlTransfer:
    cache = torch.empty(2, 2, 8, 16, 4)  # slots, K/V, blocks, tokens, width
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)))
    return nixl.NixlTransfer(KvRegions(cache, "token-major", []), name, name)


async def _connect_while_the_loop_works(reader, holder) -> None:
    reader._lock.acquire()  # a connect's agent call in progress: NIXL is not thread-safe
    connect = asyncio.create_task(asyncio.to_thread(reader.add_peer, holder.agent()))
    await asyncio.sleep(0.05)
    assert holder.name not in reader.peers  # not before its descriptors and connection
    assert reader.take_notifications() == []  # the loop does not wait for the connect
    reader._lock.release()
    await connect
    assert holder.name in reader.peers
    # another peer's connect holds the agent: a transfer to a listed peer waits, polling
    # (KvEndpoint reads only from listed peers: an unlisted one is its wait, not this one)
    reader._lock.acquire()
    read = asyncio.create_task(reader.read(holder.name, [[1, 2]], [[5, 6]], "t1"))
    await asyncio.sleep(0.05)
    assert not read.done()
    reader._lock.release()
    assert await asyncio.wait_for(read, 10.0) > 0


def test_a_peer_is_listed_once_connected_and_the_loop_never_blocks_on_it():
    reader, holder = _transfer("reader", 1), _transfer("holder", 2)
    try:
        asyncio.run(_connect_while_the_loop_works(reader, holder))
        ours, theirs = reader.regions.kv_cache, holder.regions.kv_cache
        assert torch.equal(ours[:, :, 5:7], theirs[:, :, 1:3])
        assert not torch.equal(ours[:, :, 0], theirs[:, :, 0])  # nothing else moved
    finally:
        reader.close(), holder.close()
