"""OpenAI's and vLLM's ways of asking for structured outputs and tools, onto one
`structured_outputs` spec of the GenerateRequest, and the tool mode that shapes the answer.

Sources, at most one a request (else a 400 naming the second): `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` and `guided_*`, and
`tool_choice` `required` or named (enforced by a JSON schema built from the tools, as vLLM).

A spec is checked in two steps: its sizes against the grammar limits as it is built (a walk
over the spec, milliseconds), then `check_compiles`, awaited, compiles it in a worker process
(engine/structured/compile_pool.py): the gateway's event loop never runs llguidance.
"""

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from kvpager.engine.frontend.tool_calls import parameters_schema, required_schema
from kvpager.engine.structured.compile_pool import CompilePool
from kvpager.engine.structured.limits import GrammarLimits, check_schema, check_spec
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.openai import NamedToolChoice, SamplingFields
from kvpager.schemas.sampling import StructuredOutputsParams
from kvpager.services.http.errors import HttpError

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class ToolMode:
    """How a chat answer becomes tool calls: parsed (`auto`), a forced JSON array
    (`required`) or the forced arguments of `name` (`named`)."""

    kind: Literal["auto", "required", "named"]
    name: str | None = None


@dataclass(frozen=True)
class ToolSettings:
    """vLLM's flags: `--enable-auto-tool-choice` and `--tool-call-parser` (hermes only)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


def structured_spec(
    request: SamplingFields, tool_spec: dict[str, Any] | None, limits: GrammarLimits
) -> tuple[str, dict[str, Any]] | None:
    """The request's one structured-outputs spec, as StructuredOutputsParams' fields, and
    the client's field it came from; checked against `limits` (not yet compiled)."""
    found: list[tuple[str, dict[str, Any]]] = []
    form = request.response_format
    if form is not None and form.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.schema is None:
            message = "response_format: json_schema needs json_schema.schema"
            raise HttpError.invalid(message, "response_format")
        found.append(("response_format", {"json": form.json_schema.schema}))
    if request.structured_outputs is not None:
        fields = msgspec.structs.asdict(request.structured_outputs)
        found.append(("structured_outputs", fields))
    for name, field in GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, {field: value}))
    if tool_spec is not None:
        found.append(("tool_choice", tool_spec))
    if len(found) > 1:
        message = f"{found[1][0]}: only one of {found[0][0]} and {found[1][0]} may constrain"
        raise HttpError.invalid(message, found[1][0])
    if not found:
        return None
    source, fields = found[0]
    with _named(source):
        return source, _as_spec(fields, limits)


async def check_compiles(pool: CompilePool, source: str, spec: dict[str, Any]) -> None:
    """A spec that cannot be compiled is a 400 naming the client's field, before NATS; the
    compile runs in a worker process, awaited."""
    with _named(source):
        await pool.check_async(msgspec.convert(spec, StructuredOutputsParams))


@contextlib.contextmanager
def _named(source: str) -> Iterator[None]:
    """Errors of a spec as 400s naming the client's field (`source`)."""
    try:
        yield
    except msgspec.ValidationError as exc:
        raise HttpError.invalid(f"{source}: {exc}", source) from exc
    except InvalidRequestError as exc:
        param = exc.param if source == "structured_outputs" else source
        raise HttpError.invalid(str(exc).replace("structured_outputs", source, 1), param) from exc


def _as_spec(fields: dict[str, Any], limits: GrammarLimits) -> dict[str, Any]:
    """The spec's fields, a schema given as an object turned to text once its shape passed
    the limits (a schema too deep would overflow the encoder's recursion)."""
    spec = {name: value for name, value in fields.items() if value not in (None, False)}
    if isinstance(spec.get("json"), dict | bool):
        check_schema(spec["json"], limits)
        spec["json"] = json.dumps(spec["json"])
    check_spec(msgspec.convert(spec, StructuredOutputsParams), limits)
    return spec


def tool_mode(request: Any, settings: ToolSettings) -> tuple[ToolMode | None, dict | None]:
    """The chat request's tool mode, and the spec that enforces it (required, named)."""
    tools, choice = request.tools, request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise HttpError.invalid("tool_choice: needs tools", "tool_choice")
        return None, None
    if choice == "none":
        return None, None
    try:
        functions = [msgspec.to_builtins(tool.function) for tool in tools]
        return _tool_spec(request, choice, functions, settings)
    except RecursionError:  # parameters nested past the encoder's recursion: a 400, not a 500
        raise HttpError.invalid("tools: parameters are nested too deep", "tools") from None


def _tool_spec(request: Any, choice: Any, functions: list[dict], settings: ToolSettings):
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            message = f"tool_choice: no tool is named {choice.function.name!r}"
            raise HttpError.invalid(message, "tool_choice")
        spec = {"json": json.dumps(parameters_schema(named[0]))}
        return ToolMode("named", choice.function.name), spec
    if choice == "required":
        parallel = request.parallel_tool_calls is not False
        return ToolMode("required"), {"json": json.dumps(required_schema(functions, parallel))}
    if not (settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"):
        message = (
            'tool_choice: "auto" needs the gateway started with --enable-auto-tool-choice and '
            '--tool-call-parser hermes (or send tool_choice "required", "none" or named)'
        )
        raise HttpError.invalid(message, "tool_choice")
    return ToolMode("auto"), None


def tool_definitions(request: Any) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (OpenAI's shape, as plain dicts)."""
    if not request.tools:
        return None
    return [msgspec.to_builtins(tool) for tool in request.tools]


def template_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant turn's calls for the template: arguments as a dict (HF templates
    render `arguments | tojson`), as vLLM hands them."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        function = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": call.type, "function": function})
    return out
