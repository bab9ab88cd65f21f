"""The JSON Schema of the public API: `kvpager schema`, checked in as schemas/public.schema.json."""

import inspect
import json
from typing import Any

import msgspec
from kvpager.schemas import public

# subject suffix (after the prefix) -> what is sent, what comes back
SUBJECTS = {
    "generate": ("GenerateRequest", "GenerateEvent"),
    "abort": ("AbortRequest", None),
    "health": (None, "Health"),
    "stats": (None, "Stats"),
    "models": (None, "ModelList"),
    "tokenize": ("TokenizeRequest", "TokenizeResult"),
    "detokenize": ("DetokenizeRequest", "DetokenizeResult"),
}
PUBLIC_TYPES = (
    public.GenerateRequest,
    public.GenerateEvent,
    public.AbortRequest,
    public.Health,
    public.Stats,
    public.ModelList,
    public.TokenizeRequest,
    public.TokenizeResult,
    public.DetokenizeRequest,
    public.DetokenizeResult,
)


def public_schema() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(PUBLIC_TYPES, ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvpager public API",
        "description": (public.__doc__ or "").strip(),
        "x-subjects": {
            f"<prefix>.{name}": {"request": _ref(sent), "reply": _ref(back)}
            for name, (sent, back) in SUBJECTS.items()
        },
        "$defs": _clean_descriptions(components),
    }


def _clean_descriptions(node: Any) -> Any:
    """Docstring descriptions dedented the same way whatever msgspec version made them."""
    if isinstance(node, dict):
        return {
            key: inspect.cleandoc(value)
            if key == "description" and isinstance(value, str)
            else _clean_descriptions(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(item) for item in node]
    return node


def render() -> str:
    return json.dumps(public_schema(), indent=2, sort_keys=True) + "\n"


def _ref(name: str | None) -> dict[str, str] | None:
    return None if name is None else {"$ref": f"#/$defs/{name}"}
