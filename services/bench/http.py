"""A streaming OpenAI-compatible client for `kvpager bench serve`, on asyncio streams alone.

One connection a request (`Connection: close`), HTTP/1.1, chunked or plain bodies, server-sent
events: what `/v1/completions` with `"stream": true` answers, from kvpager's gateway, vLLM or
any other OpenAI-compatible server. Kept dependency-free so the installed command needs no
HTTP library beyond the standard one.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvpager.services.bench.metrics import RequestOutcome


class BenchHttpError(Exception):
    """The server answered a request with an error status or a malformed stream."""


@dataclass(frozen=True)
class OpenAIBackend:
    """Sends one token-id prompt to `<base_url>/v1/completions`, streamed, EOS ignored."""

    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    api_key: str | None = None

    async def send(self, prompt_token_ids: list[int], max_tokens: int) -> RequestOutcome:
        body = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        outcome = RequestOutcome(len(prompt_token_ids), sent_at=time.perf_counter())
        num_chunks = 0
        try:
            async for event in post_events(self.base_url + "/v1/completions", body, self.api_key):
                if "error" in event:  # an error event ends the stream
                    raise BenchHttpError(str(event["error"]))
                usage = event.get("usage")
                if usage:  # the last chunk: the server's own count of the tokens
                    outcome.num_output_tokens = usage["completion_tokens"]
                if any(choice.get("text") for choice in event.get("choices", ())):
                    outcome.chunk_times.append(time.perf_counter())
                    num_chunks += 1
        except (OSError, BenchHttpError, ValueError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            return outcome
        outcome.done_at = time.perf_counter()
        outcome.num_output_tokens = outcome.num_output_tokens or num_chunks
        return outcome


async def post_events(url: str, body: dict, api_key: str | None = None) -> AsyncIterator[dict]:
    """POST `body` as JSON and yield each server-sent event's JSON until `[DONE]`."""
    async with _exchange(url, "POST", json.dumps(body), api_key) as (status, chunks):
        if status != 200:
            text = b"".join([chunk async for chunk in chunks]).decode(errors="replace")
            raise BenchHttpError(f"HTTP {status}: {text[:500]}")
        async for event in _events(chunks):
            yield event


async def get_json(url: str, api_key: str | None = None) -> dict:
    """GET `url` and its JSON body (`/v1/models`)."""
    async with _exchange(url, "GET", None, api_key) as (status, chunks):
        text = b"".join([chunk async for chunk in chunks]).decode(errors="replace")
    if status != 200:
        raise BenchHttpError(f"HTTP {status} from {url}: {text[:500]}")
    return json.loads(text)


@contextlib.asynccontextmanager
async def _exchange(url: str, method: str, payload: str | None, api_key: str | None):
    """One request on its own connection: the status and the body's chunks as they arrive."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=secure or None)
    try:
        writer.write(_request(method, parts.netloc, parts.path or "/", payload, api_key))
        await writer.drain()
        status, headers = await _read_head(reader)
        chunked = "chunked" in headers.get("transfer-encoding", "")
        yield status, (_chunked(reader) if chunked else _plain(reader))
    finally:
        writer.close()


def _request(method: str, host: str, path: str, payload: str | None, api_key: str | None) -> bytes:
    data = payload.encode() if payload is not None else b""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if payload is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        lines.append("Accept: text/event-stream")
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readline()).decode("latin-1").split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        raise BenchHttpError(f"not an HTTP response: {' '.join(status_line)!r}")
    headers = {}
    while line := (await reader.readline()).decode("latin-1").strip():
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return int(status_line[1]), headers


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
        yield await reader.readexactly(size)
        await reader.readline()  # the CRLF after each chunk


async def _plain(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(65536):
        yield chunk


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """Server-sent events' `data:` payloads as JSON; an event may span chunks."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk.replace(b"\r\n", b"\n")
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
