"""Where a request's blocks lie in an executor's cache, as byte ranges.

The cache is one tensor [slots, 2, blocks, ...] (engine/worker/kv_cache.py) that every KV
group shares: block `b` of any group is `slots x 2` regions, region `j` (slot j // 2, K or V
j % 2) at `base + (j * num_blocks + b) * region_bytes`. A transfer pairs the regions of local
and remote blocks index for index, so the two caches must agree on everything that gives the
bytes their meaning: dtype, block size, heads, layout, and an fp8 cache's per-layer scales.
"""

import torch
from kvpager.schemas.errors import KvTransferError
from kvpager.schemas.kv_transfer import KvAgent

MAX_PEER_BLOCKS = 2**24  # as the scheduler's bound on an executor (engine/core.py)

# per KV group: block ids (a group's table; groups share the pool, so ids never repeat)
GroupBlocks = list[list[int]]


def flat_blocks(remote: GroupBlocks, local: GroupBlocks) -> tuple[list[int], list[int]]:
    """Both sides flattened, group after group; they must pair one to one in every group."""
    if len(remote) != len(local):
        raise KvTransferError(f"{len(remote)} KV groups sent, {len(local)} to receive them")
    for group, (theirs, ours) in enumerate(zip(remote, local)):
        if len(theirs) != len(ours):
            raise KvTransferError(f"KV group {group}: {len(theirs)} blocks to {len(ours)}")
    return [b for group in remote for b in group], [b for group in local for b in group]


class KvRegions:
    """The byte ranges of one executor's cache, and its card for peers (`agent`)."""

    def __init__(self, kv_cache: torch.Tensor, kv_layout: str, kv_scales: list[float]) -> None:
        assert kv_cache.is_contiguous(), "the KV cache must be one contiguous tensor"
        self.kv_cache = kv_cache
        self.num_regions = kv_cache.shape[0] * kv_cache.shape[1]  # slots x (K, V)
        self.num_blocks = kv_cache.shape[2]
        self.region_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.kv_layout = kv_layout
        self.kv_scales = [float(scale) for scale in kv_scales]

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.kv_cache.device.type == "cuda" else "DRAM"

    @property
    def device_id(self) -> int:
        return self.kv_cache.device.index or 0

    def agent(self, name: str, instance: str, backend: str, metadata: bytes = b"") -> KvAgent:
        cache = self.kv_cache
        return KvAgent(
            name=name,
            instance=instance,
            backend=backend,
            metadata=metadata,
            mem_type=self.mem_type,
            device_id=self.device_id,
            base_address=cache.data_ptr(),
            num_regions=self.num_regions,
            num_blocks=self.num_blocks,
            region_bytes=self.region_bytes,
            kv_dtype=str(cache.dtype).removeprefix("torch."),
            block_size=cache.shape[3],
            kv_layout=self.kv_layout,
            kv_scales=self.kv_scales,
        )

    def check_peer(self, peer: KvAgent) -> None:
        """Raise KvTransferError unless the peer's blocks hold bytes that mean the same here."""
        ours = self.agent(peer.name, peer.instance, peer.backend)
        for field in ("num_regions", "region_bytes", "kv_dtype", "block_size", "kv_layout"):
            if getattr(peer, field) != getattr(ours, field):
                theirs, mine = getattr(peer, field), getattr(ours, field)
                raise KvTransferError(f"peer {peer.name}: {field} {theirs!r}, ours {mine!r}")
        if peer.kv_scales != ours.kv_scales:
            raise KvTransferError(f"peer {peer.name}: its fp8 KV scales differ from ours")
        if not 0 < peer.num_blocks <= MAX_PEER_BLOCKS:
            raise KvTransferError(f"peer {peer.name}: {peer.num_blocks} blocks")

    def check_blocks(self, block_ids: list[int], num_blocks: int, whose: str) -> None:
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:
            raise KvTransferError(f"{whose} block ids out of range 0..{num_blocks - 1}: {bad[:8]}")
        if len(set(block_ids)) != len(block_ids):
            raise KvTransferError(f"{whose} block ids repeat")

    def region_index(self, block_ids: list[int], num_blocks: int) -> list[int]:
        """Descriptor indices of the blocks' regions, region-major: [j * num_blocks + b]."""
        return [j * num_blocks + b for j in range(self.num_regions) for b in block_ids]

    def descriptors(self, base: int, num_blocks: int, device_id: int) -> list[tuple[int, int, int]]:
        """(address, bytes, device) of every region of every block of a cache at `base`."""
        size = self.region_bytes
        return [(base + i * size, size, device_id) for i in range(self.num_regions * num_blocks)]

    # --- the NATS fallback's bytes ----------------------------------------------------------

    def gather(self, block_ids: list[int]) -> bytes:
        """The blocks' bytes, [slots, 2, len(block_ids), ...] in C order."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)
        picked = self._raw.index_select(2, index).contiguous()
        return picked.cpu().numpy().tobytes()

    @property
    def _raw(self) -> torch.Tensor:
        """The cache as bytes (index ops on uint8 work for every dtype, fp8 included)."""
        return self.kv_cache.view(torch.uint8)

    def num_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.num_regions * self.region_bytes

    def scatter(self, block_ids: list[int], data: bytes | bytearray) -> None:
        """Write `gather`'s bytes of as many blocks into `block_ids`."""
        if len(data) != self.num_bytes(len(block_ids)):
            raise KvTransferError(
                f"{len(data)} bytes arrived for {len(block_ids)} blocks "
                f"({self.num_bytes(len(block_ids))} expected)"
            )
        raw = self._raw
        shape = (*raw.shape[:2], len(block_ids), *raw.shape[3:])
        values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(shape)
        index = torch.tensor(block_ids, dtype=torch.int64, device=raw.device)
        raw.index_copy_(2, index, values.to(raw.device))
