"""The longest cached prefix of a request's blocks, by attention type (vLLM's
find_longest_cache_hit): full attention needs every block of the prefix, a sliding window only
the blocks inside the window of the prefix's end (those before it are NULL_BLOCK entries), a
chunked group only the blocks of the chunk its end falls in.
Queries only: nothing here takes or references a block.
"""

from kvpager.engine.kv.block_pool import NULL_BLOCK, BlockPool, CachedBlock


def full_attention_hit(
    pool: BlockPool, tokens: list[int], hashes: list[bytes], max_blocks: int, block_size: int
) -> list[CachedBlock]:
    """The cached blocks from the first on, up to the first miss or `max_blocks`."""
    hits: list[CachedBlock] = []
    for block_idx in range(min(max_blocks, len(hashes))):
        hit = _lookup_block(pool, tokens, hashes, block_idx, block_size)
        if hit is None:
            break
        hits.append(hit)
    return hits


def sliding_window_hit(
    pool: BlockPool,
    tokens: list[int],
    hashes: list[bytes],
    max_blocks: int,
    block_size: int,
    window: int,
) -> list[CachedBlock]:
    """The longest prefix whose last ceil((window - 1) / block_size) blocks are cached
    (vLLM's sliding-window rule), scanning back from `max_blocks`."""
    needed = max(1, -(-(window - 1) // block_size))
    run: list[CachedBlock] = []  # cached blocks ending at the current candidate end
    for block_idx in range(max_blocks - 1, -1, -1):
        hit = _lookup_block(pool, tokens, hashes, block_idx, block_size)
        if hit is None:
            run = []
            continue
        run.insert(0, hit)
        if len(run) == needed:
            return [CachedBlock(NULL_BLOCK)] * block_idx + run
    return run  # a prefix shorter than the window, cached from its first block


def chunked_hit(
    pool: BlockPool,
    tokens: list[int],
    hashes: list[bytes],
    max_blocks: int,
    block_size: int,
    chunk: int,
) -> list[CachedBlock]:
    """The longest prefix whose blocks from the start of the chunk of its end are cached (at
    least its last block, as a sliding window's rule keeps one): the next token sees its own
    chunk only. One scan back from `max_blocks`, each block looked up once: a miss at block i
    fails every end past i, so the next candidate ends at i."""
    end, run = max_blocks, []  # run: cached blocks from end - 1 down, newest first
    for block_idx in range(max_blocks - 1, -1, -1):
        hit = _lookup_block(pool, tokens, hashes, block_idx, block_size)
        if hit is None:
            end, run = block_idx, []
            continue
        run.append(hit)
        if block_idx == min(end - 1, end * block_size // chunk * chunk // block_size):
            return [CachedBlock(NULL_BLOCK)] * block_idx + run[::-1]
    return []


def _lookup_block(
    pool: BlockPool, tokens: list[int], hashes: list[bytes], block_idx: int, block_size: int
) -> CachedBlock | None:
    start = block_idx * block_size
    return pool.lookup(hashes[block_idx], tuple(tokens[start : start + block_size]))
