"""One walk over a parsed JSON schema: its depth with `$ref` hops, and what it holds.

Depth counts every object and array on a path from the root, plus one a `$ref` followed
(local refs, `#/...`); a ref already on the path (a recursive schema, legitimate) adds
nothing. Each ref target's height is remembered, so diamonds of refs cost one visit. The
walk stops at the first limit passed, so its recursion never goes deeper than `max_depth`.
"""

from typing import Any, Protocol

INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1  # what a 64-bit signed or unsigned int holds
_ALTERNATIVES = ("anyOf", "oneOf", "allOf")


class SchemaLimits(Protocol):
    """What the walk reads of engine/structured/limits.py's GrammarLimits."""

    max_rules: int
    max_depth: int
    max_alternatives: int
    max_subschemas: int
    max_patterns: int


class _Over(Exception):
    """A limit passed: (what, the limit, the setting's short name)."""


class SchemaWalk:
    """Walk `schema` once (`run`); `patterns` then holds its regexes."""

    def __init__(self, schema: Any, limits: SchemaLimits) -> None:
        self.root = schema
        self.limits = limits
        self.patterns: list[str] = []
        self.num_objects = 0
        self._heights: dict[str, int] = {}  # ref -> height of its target
        self._on_path: set[str] = set()

    def run(self) -> tuple[str, int, str] | None:
        """None when within every limit, else (what, limit, setting name) of the first."""
        try:
            self._check_defs(self.root)
            self._height(self.root, 1)
        except _Over as over:
            return over.args
        return None

    def _height(self, node: Any, depth: int) -> int:
        """The levels below and including `node`, found at `depth` on the current path."""
        limits = self.limits
        if depth > limits.max_depth:
            raise _Over("nesting (with $ref hops)", limits.max_depth, "depth")
        if isinstance(node, list):
            return 1 + max((self._height(item, depth + 1) for item in node), default=0)
        if isinstance(node, int) and not isinstance(node, bool):
            if not INT_MIN <= node <= INT_MAX:
                raise _Over("an integer beyond 64 bits", 64, "integer-bits")
            return 0
        if not isinstance(node, dict):
            return 0
        self._note_object(node)
        below = 0
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                below = max(below, self._ref_height(value, depth))
            else:
                below = max(below, self._height(value, depth + 1))
        return 1 + below

    def _ref_height(self, ref: str, depth: int) -> int:
        if ref in self._on_path:
            return 0  # recursion: the compiler ties the knot, no deeper
        height = self._heights.get(ref)
        if height is None:
            target = _resolve(self.root, ref)
            self._on_path.add(ref)
            height = self._height(target, depth + 1) if target is not None else 0
            self._on_path.discard(ref)
            self._heights[ref] = height
        if depth + height > self.limits.max_depth:
            raise _Over("nesting (with $ref hops)", self.limits.max_depth, "depth")
        return height

    def _note_object(self, node: dict) -> None:
        limits = self.limits
        self.num_objects += 1
        if self.num_objects > limits.max_subschemas:
            raise _Over("the number of subschemas", limits.max_subschemas, "subschemas")
        for key in _ALTERNATIVES:
            options = node.get(key)
            if isinstance(options, list) and len(options) > limits.max_alternatives:
                raise _Over(f"the size of one {key}", limits.max_alternatives, "alternatives")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            self.patterns.append(pattern)
        keyed = node.get("patternProperties")
        if isinstance(keyed, dict):
            self.patterns += [key for key in keyed if isinstance(key, str)]
        if len(self.patterns) > limits.max_patterns:
            raise _Over("the number of patterns", limits.max_patterns, "patterns")

    def _check_defs(self, root: Any) -> None:
        if not isinstance(root, dict):
            return
        for key in ("$defs", "definitions"):
            defs = root.get(key)
            if isinstance(defs, dict) and len(defs) > self.limits.max_rules:
                raise _Over(f"the number of {key}", self.limits.max_rules, "rules")


def _resolve(root: Any, ref: str) -> Any:
    """The target of a local JSON pointer (`#/$defs/Name`), None when not local or absent."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
