"""The two clients of benchmarks/serving/conversations.py, both on token ids so that outputs can
be compared token for token: kvpager's NATS API and vLLM's OpenAI completions API (a prompt of
token ids, `return_token_ids` for the answer's). Each `complete` streams one greedy answer and
returns a `Completion`."""

import time
from dataclasses import dataclass

from kvpager.services.client import Client

from benchmarks.serving.agent_clients import NAME


@dataclass
class Completion:
    ttft_s: float
    token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the cache, any tier
    num_disk_tokens: int = 0  # of those, read from kvpager's disk tier for this request


class KvpagerTokens:
    def __init__(self, client: Client) -> None:
        self.client = client

    async def complete(self, prompt_token_ids: list[int], max_tokens: int) -> Completion:
        sent, ttft, tokens, cached, disk = time.perf_counter(), None, [], 0, 0
        async for event in self.client.generate(
            prompt_token_ids=prompt_token_ids,
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
        ):
            assert event.error is None, event.error
            if event.token_ids and ttft is None:
                ttft = time.perf_counter() - sent
            tokens += event.token_ids
            if event.is_final:
                cached = event.usage.num_cached_prompt_tokens
                disk = event.usage.cached_tokens_by_tier.get("disk", 0)
        return Completion(ttft or 0.0, tokens, cached, disk)


class VllmTokens:
    """vLLM's /v1/completions; the server needs `--enable-prompt-tokens-details` for the cached
    count."""

    def __init__(self, base_url: str) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)

    async def complete(self, prompt_token_ids: list[int], max_tokens: int) -> Completion:
        sent, ttft, tokens, cached = time.perf_counter(), None, [], 0
        stream = await self.client.completions.create(
            model=NAME,
            prompt=prompt_token_ids,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            delta = _token_ids(chunk)
            if delta and ttft is None:
                ttft = time.perf_counter() - sent
            tokens += delta
            if chunk.usage is not None:
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                cached = (getattr(details, "cached_tokens", None) or 0) if details else 0
        assert len(tokens) == max_tokens, f"vLLM answered {len(tokens)} of {max_tokens} tokens"
        return Completion(ttft or 0.0, tokens, cached)


def _token_ids(chunk) -> list[int]:
    """A streamed chunk's new token ids (an extra field the openai client keeps as is)."""
    if not chunk.choices:
        return []
    return list(getattr(chunk.choices[0], "token_ids", None) or [])
