"""The KV transfer interface: an executor's cache blocks moved to or from a peer executor.

Block ids go in and out per KV group (`GroupBlocks`), which is what prefill/decode
disaggregation hands over too: the receiver allocates its blocks, reads the sender's
(`read`), or the sender writes into blocks the receiver named (`write`). A transfer ends with
a notification at the other side (`take_notifications`): only then may that side's scheduler
free the blocks it sent. Every failure, a timeout included, is a KvTransferError, and the
caller recomputes instead; the blocks stay the caller's to free.
"""

import abc

from kvpager.engine.worker.kv_transfer.regions import GroupBlocks, KvRegions
from kvpager.schemas.kv_transfer import KvAgent

DEFAULT_TIMEOUT_S = 30.0


class KvTransfer(abc.ABC):
    """One executor's transfer endpoint over its cache (`regions`)."""

    backend: str  # "nixl" or "nats"

    def __init__(self, regions: KvRegions, name: str, instance: str) -> None:
        self.regions = regions
        self.name = name
        self.instance = instance
        self.peers: dict[str, KvAgent] = {}

    @abc.abstractmethod
    def agent(self) -> KvAgent:
        """This endpoint's card, for peers (published at attach)."""

    def add_peer(self, peer: KvAgent) -> None:
        """Know a peer, checked against our cache; connect ahead of the first transfer."""
        self.regions.check_peer(peer)
        self.peers[peer.name] = peer

    def remove_peer(self, name: str) -> None:
        self.peers.pop(name, None)

    @abc.abstractmethod
    async def read(
        self,
        peer: str,
        remote: GroupBlocks,
        local: GroupBlocks,
        transfer_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        """Copy the peer's `remote` blocks into our `local` ones; the peer is then notified
        with `transfer_id`. Returns the bytes moved; KvTransferError on any failure."""

    @abc.abstractmethod
    async def write(
        self,
        peer: str,
        local: GroupBlocks,
        remote: GroupBlocks,
        transfer_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        """Copy our `local` blocks into the peer's `remote` ones; the peer is then notified
        with `transfer_id`. Returns the bytes moved; KvTransferError on any failure."""

    @abc.abstractmethod
    def take_notifications(self) -> list[str]:
        """Transfer ids whose other side finished since the last call (our blocks are free
        to go: they were read, or they were written)."""

    def close(self) -> None:  # noqa: B027  (nothing to release by default)
        """Release what the endpoint registered."""
