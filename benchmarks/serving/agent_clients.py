"""The two clients of benchmarks/serving/agent_conversations.py: kvpager's NATS API (with the
`cache` field that pins a prefix) and the OpenAI chat API (kvpager's gateway and vLLM alike).
Each `chat` streams one greedy reply and returns (TTFT s, text, Usage)."""

import argparse
import time

import msgspec
from kvpager.schemas.public import GenerateRequest, Usage
from kvpager.services.client import Client

NAME = "agent-bench"  # the served model name both servers answer to


class NatsBackend:
    def __init__(self, client: Client, args: argparse.Namespace, pins: bool) -> None:
        self.client, self.args, self.pins = client, args, pins

    async def chat(self, messages: list[dict], max_tokens: int, pin: bool) -> tuple:
        fields = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        fields["ignore_eos"] = True
        if pin and self.pins:
            cache = {"ttl": self.args.ttl}
            if self.args.pin == "system":
                cache["prefix_messages"] = 1
            fields["cache"] = cache
        request = msgspec.convert(fields, GenerateRequest)
        sent, ttft, text, usage = time.perf_counter(), None, [], None
        async for event in self.client.generate(request):
            if event.error is not None:
                raise RuntimeError(f"{event.error.type}: {event.error.message}")
            if event.token_ids and ttft is None:
                ttft = time.perf_counter() - sent
            text.append(event.text)
            usage = event.usage or usage
        return ttft or 0.0, "".join(text), usage


class OpenAIBackend:
    def __init__(self, base_url: str) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)

    async def chat(self, messages: list[dict], max_tokens: int, pin: bool) -> tuple:
        sent, ttft, text, usage = time.perf_counter(), None, [], None
        stream = await self.client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - sent
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        return ttft or 0.0, "".join(text), _usage(usage)


def _usage(openai_usage) -> Usage:
    details = getattr(openai_usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", None) or 0) if details else 0
    return Usage(
        num_prompt_tokens=openai_usage.prompt_tokens,
        num_completion_tokens=openai_usage.completion_tokens,
        num_cached_prompt_tokens=cached,
        cached_tokens_by_tier={"device": cached} if cached else {},
    )
