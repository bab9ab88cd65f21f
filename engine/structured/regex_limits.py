"""The largest repetition a regex asks for: one `{n,m}`, or the product of nested ones.

`a{1000}{1000}` or `(a{1000}){1000}` asks the compiler for a million copies of `a`, though
each bound alone looks modest. One pass over the text, with a stack of open groups; a
group's weight is the largest product inside it, and a quantifier multiplies the weight of
the atom before it. Escapes and character classes are skipped; unbalanced parentheses are
tolerated (the compile names them).
"""

import re

_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def max_repeat(pattern: str) -> int:
    """The largest product of nested repetition bounds in `pattern` (1: none)."""
    stack: list[int] = []  # per open group: the largest weight inside it so far
    group_max, last, best = 1, 1, 1  # this group's largest, the last atom's weight
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            group_max, last, i = max(group_max, 1), 1, i + 2
            continue
        if char == "[":
            i, last = _class_end(pattern, i), 1
            continue
        if char == "(":
            stack.append(group_max)
            group_max, last = 1, 1
        elif char == ")" and stack:
            last, group_max = group_max, max(stack.pop(), group_max)
        elif char == "{" and (match := _QUANTIFIER.match(pattern, i)):
            bound = max(int(value) for value in match.groups() if value)
            last *= max(bound, 1)
            group_max, best = max(group_max, last), max(best, last)
            i = match.end()
            continue
        elif char not in "*+?|":
            last = 1
        i += 1
    return max(best, group_max)


def _class_end(pattern: str, start: int) -> int:
    """The index after a character class `[...]` opening at `start` (escapes, `]` first)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1
