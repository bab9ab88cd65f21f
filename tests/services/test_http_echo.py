"""Completions' `echo` and vLLM's `prompt_logprobs` through the gateway of `kvpager serve`:
the prompt's logprobs equal transformers' log-softmax on the same fp32 weights (within 1e-3),
whole and streamed, with `max_tokens: 0`, past a warm prefix cache; every KV block is free
after each test (the `nats_client` fixture)."""

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.helpers import random_prompts
from tests.services.http_fixture import nats_client, served  # noqa: F401

TOLERANCE = 1e-3
PROMPT = "Paged attention stores keys and values in fixed-size blocks."


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return logits.log_softmax(dim=-1)[:-1]  # row i scores prompt[i + 1]

    return logprobs, tokenizer


async def post(served, route: str, **body) -> httpx.Response:  # noqa: F811
    async with httpx.AsyncClient(timeout=60.0) as http:
        return await http.post(f"{served.api_url}/{route}", json={"model": "m", **body})


async def model_name(served) -> str:  # noqa: F811
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{served.api_url}/models")).json()["data"][0]["id"]


def check_legacy(want: torch.Tensor, prompt: list[int], logprobs: dict, texts, k: int = 1) -> None:
    """The prompt's part of a completions logprobs object, as lm-eval reads it."""
    num = len(prompt)
    assert logprobs["tokens"][:num] == [texts.decode([t]) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i, token_id in enumerate(prompt[1:]):
        got = logprobs["token_logprobs"][i + 1]
        assert abs(got - want[i, token_id].item()) < TOLERANCE, (i, got)
        if k == 0:
            assert logprobs["top_logprobs"][i + 1] == {texts.decode([token_id]): got}
            continue
        # {text: logprob} of the token itself, then the best: the first of a text wins
        best = want[i].argmax().item()
        first = token_id if texts.decode([token_id]) == texts.decode([best]) else best
        top = logprobs["top_logprobs"][i + 1]
        assert abs(top[texts.decode([best])] - want[i, first].item()) < TOLERANCE
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


async def test_echo_with_logprobs_like_lm_eval(served, reference, nats_client):  # noqa: F811
    """lm-eval's loglikelihood request: token ids, max_tokens 1, logprobs 1, echo."""
    logprobs, tokenizer = reference
    model = await model_name(served)
    prompts = random_prompts([23, 7], seed=11)
    answer = await post(
        served, "completions", model=model, prompt=prompts, max_tokens=1, logprobs=1,
        echo=True, temperature=0,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    for prompt, choice in zip(prompts, answer.json()["choices"]):
        assert choice["text"].startswith(tokenizer.decode(prompt))
        legacy = choice["logprobs"]
        assert len(legacy["tokens"]) == len(prompt) + 1  # the prompt, then the token generated
        check_legacy(logprobs(prompt), prompt, legacy, tokenizer)
        assert len(choice["prompt_logprobs"]) == len(prompt)  # vLLM adds its own field too
    assert answer.json()["usage"]["completion_tokens"] == 2


async def test_prompt_logprobs_field(served, reference, nats_client):  # noqa: F811
    """vLLM's `prompt_logprobs: k` on completions (per choice) and chat (beside the choices)."""
    logprobs, tokenizer = reference
    model = await model_name(served)
    answer = await post(served, "completions", model=model, prompt=PROMPT, max_tokens=2,
                        prompt_logprobs=3, n=2, temperature=0)  # fmt: skip
    assert answer.status_code == 200, answer.text
    prompt = tokenizer.encode(PROMPT)
    want = logprobs(prompt)
    for choice in answer.json()["choices"]:
        assert not choice["text"].startswith(PROMPT)  # no echo
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for i, (token_id, entry) in enumerate(zip(prompt[1:], entries[1:])):
            own = entry[str(token_id)]
            assert abs(own["logprob"] - want[i, token_id].item()) < TOLERANCE
            assert own["rank"] == int((want[i] >= want[i, token_id]).sum())
            assert own["decoded_token"] == tokenizer.decode([token_id])
            assert len(entry) in (3, 4)
    chat = await post(served, "chat/completions", model=model, max_tokens=2, prompt_logprobs=0,
                      messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    assert chat.status_code == 200, chat.text
    entries = chat.json()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.json()["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in entries[1:])  # k = 0: the prompt's token alone


async def test_max_tokens_zero_and_warm_prefix_cache(served, reference, nats_client):  # noqa: F811
    logprobs, tokenizer = reference
    model = await model_name(served)
    prompt = random_prompts([40], seed=12)[0]
    for _ in range(2):  # the second one hits the prefix cache
        warm = await post(served, "completions", model=model, prompt=prompt, max_tokens=1)
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    answer = await post(served, "completions", model=model, prompt=prompt, max_tokens=0,
                        echo=True, logprobs=0)  # fmt: skip
    assert answer.status_code == 200, answer.text
    body = answer.json()
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(prompt) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # every position computed
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    check_legacy(logprobs(prompt), prompt, choice["logprobs"], tokenizer, k=0)
    refused = await post(served, "completions", model=model, prompt=prompt, max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


async def test_streamed_echo(served, reference, nats_client):  # noqa: F811
    """The prompt comes in each choice's first chunk, with its logprobs, as vLLM streams it."""
    import json

    logprobs, tokenizer = reference
    model = await model_name(served)
    prompt = random_prompts([15], seed=13)[0]
    whole = await post(served, "completions", model=model, prompt=prompt, max_tokens=6,
                       temperature=0, echo=True, logprobs=1)  # fmt: skip
    body = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=1)
    chunks = []
    async with httpx.AsyncClient(timeout=60.0) as http:
        url = f"{served.api_url}/completions"
        async with http.stream("POST", url, json={**body, "stream": True}) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(tokenizer.decode(prompt))
    check_legacy(logprobs(prompt), prompt, first["logprobs"], tokenizer)
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    want = whole.json()["choices"][0]
    assert text == want["text"]
    offsets = [o for chunk in chunks for o in chunk["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == want["logprobs"]["text_offset"]


async def test_refusals(served, nats_client):  # noqa: F811
    model = await model_name(served)
    cases = [
        (dict(prompt="Hi", prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt="Hi", prompt_logprobs=1, stream=True), "prompt_logprobs"),
        (dict(prompt="Hi", echo=1), "echo"),
    ]
    for fields, param in cases:
        answer = await post(served, "completions", model=model, **fields)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
