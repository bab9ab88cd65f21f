"""One answer's GenerateEvents as a Responses API response: its output items, the stream's
events (`response.output_text.delta`, `response.function_call_arguments.delta`, ...), the
whole Response object, and the chat turns that a later `previous_response_id` continues from.

One builder serves both shapes: a whole response feeds it its one final event and keeps the
Response; a stream sends each event the builder gives back. Tool calls come from the chat
route's parser (services/http/tool_output.py), as chat deltas, and become `function_call`
items here.
"""

import uuid
from typing import Any

import msgspec
from kvpager.schemas.openai import FunctionCall, Message, ToolCall
from kvpager.schemas.openai_responses import ResponsesRequest
from kvpager.schemas.public import GenerateEvent, Usage
from kvpager.services.http.errors import HttpError
from kvpager.services.http.requests import Job
from kvpager.services.http.tool_output import ToolDeltas

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response `response_id` to `request`, answered by `job` (one prompt, one sample)."""

    def __init__(self, job: Job, request: ResponsesRequest, response_id: str) -> None:
        self.job, self.request, self.response_id = job, request, response_id
        self.status = "in_progress"
        self.items: list[dict[str, Any]] = []  # the output, in order
        self.usage: Usage | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self._num_events = 0
        self._text: dict[str, Any] | None = None  # the message item being written
        self._calls: dict[int, dict[str, Any]] = {}  # open function_call items, by call index
        self._tools = None if job.tool_mode is None else ToolDeltas(job.tool_mode)

    def start(self) -> list[Event]:
        return [self._event("response.created"), self._event("response.in_progress")]

    def feed(self, event: GenerateEvent) -> list[Event]:
        """The stream's events for one GenerateEvent; its last closes the output."""
        if event.usage is not None:
            self.usage = event.usage
        final = event.finish_reason is not None
        if self._tools is None:
            out = self._text_delta(event.text) if event.text else []
        else:
            out = []
            for delta in self._tools.deltas(event.text, final):
                out += self._chat_delta(delta)
        if final:
            out += self._close_all()
            self._finish(event.finish_reason)
            out.append(self._event(_END_EVENT[self.status]))
        return out

    def fail(self, error: HttpError) -> list[Event]:
        """The stream's end when the answer failed: `error`, then `response.failed`."""
        self.status = "failed"
        self.error = {"code": error.code, "message": error.message}
        fields = {"code": error.code, "message": error.message, "param": error.param}
        return [self._event("error", **fields), self._event("response.failed")]

    def body(self) -> dict[str, Any]:
        """The Response object as it stands."""
        request, job = self.request, self.job
        tool_choice = request.tool_choice
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": job.created,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": job.model,
            "output": list(self.items),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": request.store,
            "temperature": request.temperature,
            "text": {"format": _format(request)},
            "tool_choice": "auto" if tool_choice is None else _builtins(tool_choice),
            "tools": request.tools or [],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": None if self.usage is None else usage(self.usage),
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def turns(self) -> list[Message]:
        """The answer as chat turns: its text and its calls, in one assistant turn."""
        texts = [part["text"] for item in self.items if item["type"] == "message"
                 for part in item["content"]]  # fmt: skip
        calls = [
            ToolCall(id=item["call_id"], function=FunctionCall(item["name"], item["arguments"]))
            for item in self.items
            if item["type"] == "function_call"
        ]
        content = "".join(texts) if texts or not calls else None
        return [Message(role="assistant", content=content, tool_calls=calls or None)]

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        if kind.startswith("response.") and kind.count(".") == 1:  # the lifecycle's events
            event["response"] = self.body()
        return event

    def _text_delta(self, text: str) -> list[Event]:
        out = []
        if self._text is None:
            out += self._open_message()
        item = self._text
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        out.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return out

    def _chat_delta(self, delta: dict[str, Any]) -> list[Event]:
        if "content" in delta:
            return self._text_delta(delta["content"]) if delta["content"] else []
        out: list[Event] = []
        for call in delta["tool_calls"]:
            if "id" in call:
                out += self._close_message()
                out += self._open_call(call)
            else:
                out += self._arguments_delta(call["index"], call["function"]["arguments"])
        return out

    def _open_message(self) -> list[Event]:
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        self._text = item
        self.items.append(item)
        index = self._index(item)
        added = self._event("response.output_item.added", output_index=index, item=_copy(item))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [added, self._event("response.content_part.added", **where, part=_copy(part))]

    def _close_message(self) -> list[Event]:
        item, self._text = self._text, None
        if item is None:
            return []
        item["status"] = "completed"
        index, part = self._index(item), item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=_copy(part)),
            self._event("response.output_item.done", output_index=index, item=_copy(item)),
        ]

    def _open_call(self, call: dict[str, Any]) -> list[Event]:
        name = call["function"]["name"]
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": name, "arguments": ""}  # fmt: skip
        self._calls[call["index"]] = item
        self.items.append(item)
        index = self._index(item)
        return [self._event("response.output_item.added", output_index=index, item=_copy(item))]

    def _arguments_delta(self, call_index: int, text: str) -> list[Event]:
        item = self._calls[call_index]
        item["arguments"] += text
        where = {"item_id": item["id"], "output_index": self._index(item)}
        return [self._event("response.function_call_arguments.delta", **where, delta=text)]

    def _close_all(self) -> list[Event]:
        out = self._close_message()
        for item in self._calls.values():
            item["status"] = "completed"
            index = self._index(item)
            where = {"item_id": item["id"], "output_index": index, "name": item["name"]}
            arguments = item["arguments"]
            out.append(self._event("response.function_call_arguments.done", **where,
                                   arguments=arguments))  # fmt: skip
            out.append(self._event("response.output_item.done", output_index=index,
                                   item=_copy(item)))  # fmt: skip
        self._calls = {}
        return out

    def _finish(self, finish_reason: str | None) -> None:
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        else:
            self.status = "completed"

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, found in enumerate(self.items) if found is item)


_END_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


def usage(found: Usage) -> dict[str, Any]:
    """kvpager's usage in the Responses API's names."""
    total = found.num_prompt_tokens + found.num_completion_tokens
    return {
        "input_tokens": found.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": found.num_cached_prompt_tokens},
        "output_tokens": found.num_completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": total,
    }


def _format(request: ResponsesRequest) -> dict[str, Any]:
    form = request.text.format if request.text is not None else None
    return {"type": "text"} if form is None else _builtins(form)


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot: later deltas change the item itself."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
