"""KV-cache groups: layers grouped by attention kind, each group with its own block tables.

A model whose layers all attend alike (most) has one group, and a block holds every layer's
K/V, as always. A model mixing kinds (Gemma 2/3: sliding layers beside full ones) splits its
layers into groups of equal size, vLLM's hybrid layout: every group draws blocks from one
shared pool, a block holds `num_slots` layers of one group, and layer `l` reads slot
`layer_slot[l]` of its group's blocks. Equal sizes keep every block the same number of bytes,
so one cache tensor [num_slots, 2, blocks, ...] serves every group, and a block id belongs to
one group at a time. Recurrent layers (Mamba2: engine/kv/state_slots.py) hold no K/V: the
groups are those of the attention layers, and a recurrent layer's entries (group 0, slot 0)
are never read. A group smaller than the others (the kinds' counts do not divide)
leaves its last slots unused: the size is picked to waste at most about a tenth of the cache.

A group's `window` is one signed int, its layers' attention span: 0 full attention, w > 0 a
sliding window (position p sees keys p - w < j <= p), -C chunked local attention (Llama 4:
p sees its own chunk of C tokens, C * (p // C) <= j <= p). Either kind frees the blocks wholly
before the first key of the next token to compute (`num_skipped_blocks`).
"""

from dataclasses import dataclass

MAX_PADDING = 0.1  # the share of the cache a group size may leave unused for fewer groups


@dataclass(frozen=True)
class KvGroups:
    windows: tuple[int, ...]  # per group: its layers' span (module docstring), 0 = full
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot inside its group's blocks
    num_slots: int  # layers of K/V one block holds

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(
    layer_windows: tuple[int, ...], num_layers: int, recurrent: tuple[bool, ...] = ()
) -> KvGroups:
    """Group layers by span (full first, then windows ascending, then chunks ascending); the
    `recurrent` layers take no part (the module docstring)."""
    windows = layer_windows or (0,) * num_layers
    if any(recurrent):
        return _without_recurrent(windows, recurrent)
    kinds = sorted(set(windows), key=lambda w: (w < 0, abs(w)))
    if len(kinds) == 1:
        return KvGroups((kinds[0],), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    members = [[i for i, w in enumerate(windows) if w == kind] for kind in kinds]
    size = _group_size([len(m) for m in members], num_layers)
    group_windows, layer_group, layer_slot = [], [0] * num_layers, [0] * num_layers
    for kind, layers in zip(kinds, members):
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KvGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


def _without_recurrent(windows: tuple[int, ...], recurrent: tuple[bool, ...]) -> KvGroups:
    attention = [i for i, is_recurrent in enumerate(recurrent) if not is_recurrent]
    inner = kv_groups(tuple(windows[i] for i in attention), len(attention))
    layer_group, layer_slot = [0] * len(recurrent), [0] * len(recurrent)
    for idx, layer in enumerate(attention):
        layer_group[layer], layer_slot[layer] = inner.layer_group[idx], inner.layer_slot[idx]
    return KvGroups(inner.windows, tuple(layer_group), tuple(layer_slot), inner.num_slots)


def _group_size(counts: list[int], num_layers: int) -> int:
    """The largest size (fewest groups) whose unused slots stay within MAX_PADDING."""
    for size in range(min(counts), 0, -1):
        padded = sum(-(-count // size) * size for count in counts)
        if padded - num_layers <= MAX_PADDING * num_layers:
            return size
    return 1


def max_blocks_per_seq(
    windows: tuple[int, ...], num_tokens: int, block_size: int, max_chunk: int
) -> int:
    """Blocks one sequence of `num_tokens` holds at its peak across all groups: a full group
    every block; a sliding group only its window's blocks plus those of the chunk being
    computed (at most `max_chunk` tokens a step); a chunked group its chunk's blocks and the
    step's (a chunk starts on a block edge: CacheConfig checks)."""
    total = 0
    for window in windows or (0,):
        full = -(-num_tokens // block_size)
        if window < 0:
            held = -(-(-window - 1 + max_chunk) // block_size)
        else:
            held = -(-(window - 1 + max_chunk) // block_size) + 1 if window else full
        total += min(full, held)
    return total


def first_visible(position: int, window: int) -> int:
    """The first key position the query at `position` sees under `window` (see the module
    docstring)."""
    if window < 0:
        return position - position % -window
    return max(0, position - window + 1) if window else 0


def num_skipped_blocks(num_computed: int, window: int, block_size: int) -> int:
    """Blocks wholly before the first key the next token to compute (at `num_computed`) sees:
    no later query reads them, so a sliding or chunked group frees them."""
    return first_visible(num_computed, window) // block_size if window else 0
