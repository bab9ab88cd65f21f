"""Chained, stable hashes of full KV blocks for the prefix cache.

hash(block i) = sha256(hash(block i-1) | token ids of block i); block 0's parent is ROOT_HASH
and, when the request has a `cache_salt`, the salt goes into block 0's hash alone (as vLLM
does): the chain carries it into every later block, so requests with different salts (API
keys) never share a cached block, and those with the same salt share as before. A 256-bit digest
makes accidental collisions negligible, and the block manager also compares token ids on every
hit, so a collision can never serve another prompt's K/V. Python's `hash()` is salted per
process and would break across the scheduler's restarts, so it is not used.
"""

import hashlib
from array import array

from kvpager.engine.request import Request

ROOT_HASH = b"kvpager-prefix-v1"


def hash_block(parent_hash: bytes, token_ids: list[int], cache_salt: str | None) -> bytes:
    digest = hashlib.sha256(parent_hash)
    if cache_salt:
        digest.update(b"salt:" + cache_salt.encode())
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` to cover every full block of its known tokens."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) < num_full:
        tokens = request.all_token_ids
        for block_idx in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else ROOT_HASH
            block_tokens = tokens[block_idx * block_size : (block_idx + 1) * block_size]
            salt = request.cache_salt if block_idx == 0 else None  # the chain carries it on
            hashes.append(hash_block(parent, block_tokens, salt))
    return hashes


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`: what a block manager holding them
    would have cached (the same hash, so routers and block managers agree)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[start : start + block_size], None))
    return hashes
