"""The disk tier's files: one full KV block each, named by its chained block hash.

    <kv_disk_dir>/<layout id>/<block hash hex>.kvb

The layout id hashes everything that makes a block's bytes mean something: the model (its
folder, config.json and weight files' names, sizes and mtimes), the KV dtype, the block size,
the layer / KV-head / head-dim layout and the tensor-parallel rank, so a file of another model
or layout is never even looked at. A file:

    header (HEADER)  |  token ids (int64 x num_tokens)  |  block bytes [layers, 2, block_size,
                                                          kv_heads, head_dim] in the KV dtype

The header repeats the layout id and the block hash and carries the payload size and a MAC of
everything else (header fields, token ids, block bytes) under a secret key kept outside the
folder (`load_key`): a checksum anyone can recompute would let whoever can write the folder feed
chosen K/V to every request sharing a prefix. The MAC is BLAKE3 in its keyed mode (a PRF under a
256-bit key): a read is bound by its MAC, and keyed BLAKE3 runs at several GB/s a core where
HMAC-SHA256 ran at 1.8 (SHA-NI; benchmarks/kernels/tier_reads.py), and releases the GIL, so the
reader threads compute it in parallel. A file that is short, long or torn
reads as a miss; one whose MAC fails raises `ForgedBlockError` (the store drops and counts it).
Files are written under a temporary name (mode 0600 whatever the umask) and renamed into place,
so readers (other instances sharing the folder) see a whole file or none.
"""

import hashlib
import hmac
import json
import os
import secrets
import struct
from array import array
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from blake3 import blake3
from kvpager.schemas.errors import ConfigError

# version 2: the CRC-32 became an HMAC-SHA256; version 3: keyed BLAKE3, ~3.5x faster (and,
# through the layout id, a new folder each time: files of an older version are never read)
MAGIC, VERSION = b"KVPB", 3
# magic, version, num_tokens, layout id, block hash, payload bytes, keyed BLAKE3
HEADER = struct.Struct("<4sII32s32sQ32s")
MAC_OFFSET = HEADER.size - 32
SUFFIX = ".kvb"
KEY_BYTES = 32


class ForgedBlockError(Exception):
    """A whole file whose MAC does not match: written without the key, or altered."""


@dataclass(frozen=True)
class BlockLayout:
    """What one block's bytes are: its shape and dtype, and the identity of the writer."""

    shape: tuple[int, ...]  # [layers, 2, block_size, kv_heads, head_dim]
    dtype: torch.dtype
    layout_id: bytes  # 32 bytes

    @cached_property  # asked once a read: computed once
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    @property
    def folder_name(self) -> str:
        return self.layout_id.hex()[:16]


def model_identity(model_path: Path) -> dict:
    """The checkpoint as found on disk: its folder, config and weight files (not their bytes:
    reading gigabytes to name a folder would cost a start-up; a re-downloaded or re-converted
    file changes its size or mtime)."""
    path = Path(model_path).resolve()
    config = path / "config.json"
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    return {
        "path": str(path),
        "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else "",
        "weights": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights],
    }


def block_layout(
    model_path: Path,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    rank: int,
    world_size: int,
    kv_layout: str = "token-major",
) -> BlockLayout:
    identity = {
        "format": VERSION,
        "model": model_identity(model_path),
        "shape": list(shape),
        "dtype": str(dtype),
        "rank": rank,
        "world_size": world_size,
    }
    if kv_layout != "token-major":  # the folders token-major caches wrote keep their names
        identity["kv_layout"] = kv_layout
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()
    return BlockLayout(tuple(shape), dtype, digest)


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def hash_of(name: str) -> bytes | None:
    """The block hash a file name stands for; None for temporary or foreign files."""
    if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:64])
    except ValueError:
        return None


def load_key(path: Path) -> bytes:
    """The disk tier's MAC key: created once (random, mode 0600, its folder 0700 if new) and
    read ever after. A key others may read or write is refused: it would authenticate their
    files."""
    path = Path(path).expanduser()
    if not path.exists():
        private_dir(path.parent)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), 0o600)
            file.write(secrets.token_bytes(KEY_BYTES))
        try:
            os.link(temporary, path)  # fails if a concurrent start made one: use theirs
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ConfigError(f"kv_disk_key_file: {path} has mode {oct(mode & 0o777)}; make it 0600")
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise ConfigError(f"kv_disk_key_file: {path} must hold {KEY_BYTES} bytes")
    return key


def private_dir(path: Path) -> None:
    """Create `path` (and missing parents) as 0700 whatever the umask; an existing folder is
    left as it is (it may be the user's, e.g. /var/tmp)."""
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)


def write_block(
    folder: Path,
    layout: BlockLayout,
    key: bytes,
    block_hash: bytes,
    token_ids: list[int],
    block: torch.Tensor,
) -> int:
    """Write one block (a contiguous CPU tensor of layout.shape) atomically; its file size."""
    tokens = torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()
    payload = memoryview(block.reshape(-1).view(torch.uint8).numpy())
    fields = (MAGIC, VERSION, len(token_ids), layout.layout_id, block_hash, len(payload))
    header = bytearray(HEADER.pack(*fields, bytes(32)))
    header[MAC_OFFSET:] = _mac(key, header, tokens, payload)
    final = folder / file_name(block_hash)
    temporary = folder / f".{final.name}.{os.getpid()}.{id(block):x}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # the umask may have taken owner bits too
        f.write(header)
        f.write(tokens)
        f.write(payload)
    os.rename(temporary, final)  # atomic: readers see the whole file or the previous one
    return HEADER.size + len(tokens) + len(payload)


def read_block(
    folder: Path,
    layout: BlockLayout,
    key: bytes,
    block_hash: bytes,
    token_ids: list[int],
    buffer: bytearray | None = None,
) -> torch.Tensor | None:
    """The block stored under `block_hash` for exactly `token_ids`, or None: missing, torn,
    of another layout or of other tokens. ForgedBlockError: a whole file failing its MAC.
    `buffer`: as read_open_block's."""
    try:
        fd = os.open(folder / file_name(block_hash), os.O_RDONLY)
    except OSError:
        return None  # vanished (evicted by a sharing instance), unreadable
    try:
        return read_open_block(fd, layout, key, block_hash, token_ids, buffer)
    finally:
        os.close(fd)


def read_open_block(
    fd: int,
    layout: BlockLayout,
    key: bytes,
    block_hash: bytes,
    token_ids: list[int],
    buffer: bytearray | None = None,
) -> torch.Tensor | None:
    """read_block's answer for the file open as `fd`: one read of the whole file into
    `buffer` (bytes reused from call to call, a reader thread's: it must hold a whole file,
    so a read allocates nothing; the block returned views it), then one MAC over it (one
    call, so BLAKE3 hashes it wide and without the GIL)."""
    expected = HEADER.size + 8 * len(token_ids) + layout.num_bytes
    data = bytearray(expected) if buffer is None else buffer
    assert len(data) >= expected, "the read buffer is smaller than a file"
    view = memoryview(data)[:expected]
    try:
        if os.fstat(fd).st_size != expected or os.readv(fd, [view]) != expected:
            return None  # short, long or torn
    except OSError:
        return None  # unreadable
    header = bytearray(view[: HEADER.size])
    header[MAC_OFFSET:] = bytes(32)
    if not hmac.compare_digest(
        _mac(key, header, view[HEADER.size :]), view[MAC_OFFSET : HEADER.size]
    ):
        raise ForgedBlockError(f"{file_name(block_hash)}: MAC mismatch")
    magic, version, num_tokens, layout_id, stored_hash, num_bytes, _ = HEADER.unpack_from(data)
    header_ok = (magic, version, layout_id, stored_hash) == (
        MAGIC,
        VERSION,
        layout.layout_id,
        block_hash,
    )
    if not header_ok or num_tokens != len(token_ids) or num_bytes != layout.num_bytes:
        return None
    offset = HEADER.size + 8 * num_tokens
    if view[HEADER.size : offset] != array("q", token_ids).tobytes():  # written in host order
        return None
    raw = torch.frombuffer(data, dtype=torch.uint8, count=num_bytes, offset=offset)
    return raw.view(layout.dtype).view(layout.shape)


def _mac(key: bytes, *parts) -> bytes:
    """Keyed BLAKE3 of the parts in order (the header with its MAC field zeroed first)."""
    mac = blake3(key=key, max_threads=1)  # one core a reader thread: the threads split files
    for part in parts:
        mac.update(part)
    return mac.digest()
