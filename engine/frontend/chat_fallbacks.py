"""What a chat template may not know, made to reach the model anyway (both front doors).

- `role: "developer"` (OpenAI's system role for newer models, the openai SDK's default) becomes
  `system` where the template has no developer turn of its own.
- Tools with a template that ignores `tools` (SmolLM2's, plain ChatML): rendered with and
  without a probe tool, such a template gives the same text, and the model would never see the
  tools. The tool list then goes into the system turn, as the default templates of vLLM and
  SGLang for such models write it (Qwen2.5's hermes format, in fewer words: JSON schemas in
  <tools>, calls as <tool_call>{"name", "arguments"}</tool_call>), so that tools are never
  silently dropped and the hermes parser reads the calls as it does for templates that know
  tools. Only where the model chooses (no structured-outputs constraint: `tool_choice` auto,
  or a NATS request with tools alone; the gateway sends no tools with `tool_choice: "none"`):
  a required or named choice is enforced by a grammar built from the tools, and their list
  would only lengthen the prompt.
"""

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "kvpager_probe_tool", "description": "", "parameters": {}},
}
_PROBE_MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS_HEADER = (
    "# Tools\n\nYou may call these functions, given as JSON schemas within <tools></tools>:\n"
    "<tools>"
)
TOOLS_FOOTER = (
    "</tools>\n\nTo call one, answer with <tool_call></tool_call> XML tags around "
    '{"name": <function-name>, "arguments": <args-json-object>}'
)


def template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template
    return json.dumps(template) if isinstance(template, dict) else str(template or "")


def with_system_roles(messages: list[dict], template: str) -> list[dict]:
    """`developer` turns as `system` unless the template names the developer role."""
    if "developer" in template or all(m.get("role") != "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """The template writes the tools it is given: a probe tool's rendering differs."""

    def render(tools: list[dict] | None) -> str:
        return tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False
        )

    try:
        return render([_PROBE_TOOL]) != render(None)
    except Exception:  # a template that refuses the probe is left to render tools its own way
        return True


def with_tools_in_system(messages: list[dict], tools: list[dict[str, Any]]) -> list[dict]:
    """The tool list in the system turn: the first message's when it is a system one, else a
    new first turn."""
    schemas = "\n".join(json.dumps(_set_fields(tool), ensure_ascii=False) for tool in tools)
    text = f"{TOOLS_HEADER}\n{schemas}\n{TOOLS_FOOTER}"
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content") or ""
        return [{**first, "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _set_fields(value: Any) -> Any:
    """A tool definition without its null fields (`"strict": null` says nothing to a model)."""
    if isinstance(value, dict):
        return {key: _set_fields(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_set_fields(item) for item in value]
    return value
