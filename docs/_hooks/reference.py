"""mkdocs hook: the reference pages' generated parts, made from the code when the site builds.

The CLI page comes from the argument parsers and the NATS page from the public JSON Schema,
so neither can drift from what `kvpager` accepts; a page only holds a marker where they go.
"""

import argparse
import json
import os
from typing import Any

CLI_MARKER = "<!-- kvpager:cli -->"
NATS_MARKER = "<!-- kvpager:nats -->"
HELP_COLUMNS = "100"  # argparse wraps to $COLUMNS: fixed, so the page is the same everywhere


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if NATS_MARKER in markdown:
        markdown = markdown.replace(NATS_MARKER, nats_reference())
    return markdown


def cli_reference() -> str:
    from kvpager.services.cli import build_parser

    parser, _ = build_parser()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        return "\n\n".join(_parser_sections(parser, "kvpager"))
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _parser_sections(parser: argparse.ArgumentParser, name: str) -> list[str]:
    sections = [f"## `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```"]
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for child_name, child in action.choices.items():
                sections += _parser_sections(child, f"{name} {child_name}")
    return sections


def nats_reference() -> str:
    from kvpager.services.schema import public_schema

    schema = public_schema()
    rows = ["| subject | request | reply |", "|---|---|---|"]
    for subject, kinds in schema["x-subjects"].items():
        request, reply = _ref_link(kinds["request"]), _ref_link(kinds["reply"])
        rows.append(f"| `{subject}` | {request} | {reply} |")
    parts = ["## Subjects", "\n".join(rows), "## Messages"]
    for name, definition in schema["$defs"].items():
        parts.append(_message_section(name, definition))
    return "\n\n".join(parts)


def _message_section(name: str, definition: dict[str, Any]) -> str:
    lines = [f"### {name}", ""]
    if definition.get("description"):
        lines += [definition["description"], ""]
    properties = definition.get("properties", {})
    if properties:
        required = set(definition.get("required", []))
        lines += ["| field | type | default | |", "|---|---|---|---|"]
        for field, spec in properties.items():
            default = "required" if field in required else _default(spec)
            description = _cell(_description(spec))
            lines.append(f"| `{field}` | {_type_of(spec)} | {default} | {description} |")
    return "\n".join(lines)


def _type_of(spec: dict[str, Any]) -> str:
    if "$ref" in spec:
        return _ref_link(spec)
    if "anyOf" in spec:
        return " or ".join(_type_of(option) for option in spec["anyOf"])
    if "enum" in spec:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in spec["enum"])
    kind = spec.get("type", "any")
    if kind == "array":
        return f"array of {_type_of(spec.get('items', {}))}"
    if kind == "object" and isinstance(spec.get("additionalProperties"), dict):
        return f"object of {_type_of(spec['additionalProperties'])}"
    return " or ".join(kind) if isinstance(kind, list) else kind


def _ref_link(spec: dict[str, Any] | None) -> str:
    if not spec:
        return "-"
    name = spec["$ref"].rsplit("/", 1)[-1]
    return f"[{name}](#{name.lower()})"


def _default(spec: dict[str, Any]) -> str:
    return _cell(f"`{json.dumps(spec['default'])}`") if "default" in spec else ""


def _description(spec: dict[str, Any]) -> str:
    """An optional field's description sits inside its non-null option."""
    options = [spec, *spec.get("anyOf", [])]
    return next((option["description"] for option in options if "description" in option), "")


def _cell(text: str) -> str:
    """Table cells hold one line, and a pipe would end the cell."""
    return " ".join(text.split()).replace("|", "\\|")
