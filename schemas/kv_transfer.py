"""What executors send one another to move KV blocks (engine/worker/kv_transfer/).

`KvAgent` is an executor's card, published over NATS when it attaches: its transfer backend,
NIXL's agent metadata (empty over the NATS fallback) and where its cache lies, so a peer can
address any (slot, K/V, block) region and check that the two caches hold the same bytes.
The NATS fallback's messages follow: a read or write is announced on the peer's KV subject,
the block bytes go in `KvChunk`s on a subject of the transfer's own, and `KvTransferDone` is the
notification that lets the sender free its blocks.
"""

import msgspec


class KvAgent(msgspec.Struct, array_like=True):
    """An executor's transfer endpoint and cache geometry (every KV group shares one pool)."""

    name: str  # unique per executor process: NIXL's agent name
    instance: str  # the kvpager instance it serves
    backend: str  # "nixl" or "nats"
    metadata: bytes  # NIXL agent metadata; b"" over NATS
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    base_address: int
    num_regions: int  # slots x 2 (K and V): a block's regions, one block apart each
    num_blocks: int
    region_bytes: int  # one (slot, K/V) of one block
    # what must agree for the bytes to mean the same (fp8 scales included)
    kv_dtype: str
    block_size: int
    kv_layout: str
    kv_scales: list[float] = []  # per layer: k_scale, v_scale (an fp8 cache's)


class KvReadRequest(msgspec.Struct, tag="read", array_like=True):
    """Send the bytes of `block_ids` (flattened over groups) as KvChunks to `subject`."""

    transfer_id: str
    block_ids: list[int]
    subject: str


class KvWriteRequest(msgspec.Struct, tag="write", array_like=True):
    """KvChunks with the bytes of as many blocks follow on `subject`: write them into
    `block_ids`, then answer on `done_subject` with a KvTransferDone."""

    transfer_id: str
    block_ids: list[int]
    subject: str
    done_subject: str
    num_bytes: int


class KvTransferDone(msgspec.Struct, tag="done", array_like=True):
    """The notification: the transfer's bytes arrived (`error` empty) or it failed."""

    transfer_id: str
    error: str = ""


KvRequest = KvReadRequest | KvWriteRequest | KvTransferDone


class KvChunk(msgspec.Struct, tag="chunk", array_like=True):
    """Bytes `offset`.. of a transfer's block bytes; `total` is the whole size."""

    transfer_id: str
    offset: int
    total: int
    data: bytes


# --- Drain migration with blocks: what the schedulers, tokenizers and executors hand on.


class KvHandoff(msgspec.Struct, array_like=True):
    """A stream's blocks, held on the instance it leaves until they are read.

    It rides on the stream's final SampleDelta to its tokenizer, then on the continuation's
    AddRequest to the next instance, whose executor reads the blocks from `agent`.
    `block_tables` are per KV group, NULL (-1) where a sliding window let a block go; the first
    `num_computed_tokens` tokens of the continuation's prompt have their K/V there.
    """

    transfer_id: str
    instance: str  # the instance that holds the blocks
    agent: str  # its executor's KvAgent name
    block_tables: list[list[int]]
    num_computed_tokens: int
    # a prefill instance's hand-off (disaggregation), not a drain: the stream goes on on a
    # decode instance, and the one it leaves stays up (no migration is counted)
    prefilled: bool = False


class KvPull(msgspec.Struct, array_like=True):
    """Read `remote` blocks of `agent` into `local` ones, after the step it rides on ran
    (its swap-outs first: a block popped for the pull may hold content going to the CPU)."""

    transfer_id: str
    agent: str
    remote: list[list[int]]
    local: list[list[int]]


class KvPulled(msgspec.Struct, tag="kv_pulled", array_like=True):
    """Executor -> its scheduler: a KvPull ended (`error` empty: every byte arrived)."""

    transfer_id: str
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""


class KvSent(msgspec.Struct, tag="kv_sent", array_like=True):
    """Executor -> its scheduler: a peer read the blocks of a handoff (NIXL's notification):
    the scheduler may free them."""

    transfer_id: str


class DrainInstance(msgspec.Struct, array_like=True):
    """`kvpager drain`: the instance refuses new requests and hands its streams on, blocks
    and all; the answer is a DrainResult."""

    instance: str


class DrainResult(msgspec.Struct, array_like=True):
    num_moved: int  # streams handed on with their blocks
    num_recomputed: int  # streams that move without them (waiting, nothing to carry)
