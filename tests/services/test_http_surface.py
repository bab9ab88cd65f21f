"""What clients send by default and the routes they call, against `kvpager serve --http-port`:
vLLM's `continuous_usage_stats`, `response_format: text`, OpenAI's no-op fields (ignored,
logged), unknown fields (refused, or with `--allow-unknown-fields`, a gateway of its own,
ignored); /tokenize, /detokenize against the model's own tokenizer, /version, /v1/models/{id}."""

import json
from functools import partial

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.services.http_fixture import gateway, nats_client, nats_text, served  # noqa: F401

MESSAGES = [{"role": "user", "content": "Hello there"}]
NO_OPS = {
    "metadata": {"run": "eval-1"},
    "store": False,
    "service_tier": "auto",
    "user": "someone",
    "reasoning_effort": "low",
}


async def _chunks(url: str, body: dict) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url, json=body) as response:
            assert response.status_code == 200, await response.aread()
            lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_continuous_usage_in_every_chunk(served, model, nats_client, kind):  # noqa: F811
    """guidellm's stream_options, unmodified: usage so far in each chunk, the total at the end."""
    prompt = {"messages": MESSAGES} if kind == "chat" else {"prompt": "The paged cache"}
    want, usage = await nats_text(nats_client, **prompt, max_tokens=12, temperature=0.0)
    body = {"model": model, **prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    path = "chat/completions" if kind == "chat" else "completions"
    chunks = await _chunks(f"{served.api_url}/{path}", body)
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    running = [chunk["usage"] for chunk in chunks[:-1]]
    assert all(u["prompt_tokens"] == usage.num_prompt_tokens for u in running)
    completion = [u["completion_tokens"] for u in running]
    assert completion == sorted(completion) and completion[-1] == 12
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running)
    key = "delta" if kind == "chat" else None
    pieces = [
        c["choices"][0][key].get("content") if key else c["choices"][0]["text"] for c in chunks[:-1]
    ]
    assert "".join(piece or "" for piece in pieces) == want


async def test_defaults_clients_send_are_accepted(served, api, model, nats_client):  # noqa: F811
    want, _ = await nats_text(nats_client, messages=MESSAGES, max_tokens=8, temperature=0.0)
    done = await api.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        response_format={"type": "text"},
        **NO_OPS,
    )
    assert done.choices[0].message.content == want
    done = await api.completions.create(
        model=model, prompt="The paged cache", max_tokens=4, extra_body={"metadata": {"a": "b"}}
    )
    assert done.usage.completion_tokens > 0


async def test_unknown_fields_are_refused_naming_them(api, model):
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(
            model=model, messages=MESSAGES, extra_body={"frobnicate": 1}
        )
    assert caught.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(
            model=model, messages=[{**MESSAGES[0], "mood": "calm"}], max_tokens=2
        )
    assert caught.value.body["param"] == "messages[0].mood"


def test_allow_unknown_fields_logs_and_ignores_them(served, tiny_llama, tmp_path):  # noqa: F811
    body = {"model": tiny_llama.name, "messages": [{**MESSAGES[0], "mood": "calm"}]}
    body |= {"frobnicate": {"x": 1}, "max_tokens": 4, "temperature": 0, "store": True}
    plain = httpx.post(f"{served.api_url}/chat/completions", json=body, timeout=60)
    assert plain.status_code == 400
    env = {"KVPAGER_ALLOW_UNKNOWN_FIELDS": "true"}
    with gateway(served, tiny_llama, tmp_path, **env) as lenient:
        response = httpx.post(f"{lenient.api_url}/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        stripped = {k: v for k, v in body.items() if k != "frobnicate"}
        stripped["messages"] = MESSAGES
        same = httpx.post(f"{lenient.api_url}/chat/completions", json=stripped, timeout=60)
        records = lenient.log_records()
    assert response.json()["choices"][0]["message"] == same.json()["choices"][0]["message"]
    ignored = [r for r in records if r.get("event") == "unknown fields ignored"]
    assert ignored and ignored[0]["fields"] == ["messages[0].mood", "frobnicate"], ignored
    no_ops = [r for r in records if r.get("event") == "fields ignored"]
    assert no_ops and no_ops[0]["fields"] == ["store"] and no_ops[0]["level"] == "debug"


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


async def test_tokenize_agrees_with_the_model_tokenizer(served, api, model, hf_tokenizer):  # noqa: F811
    prompt = "The paged cache holds blocks"
    card = (await api.models.retrieve(model)).model_extra
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        done = (await http.post("/tokenize", json={"model": model, "prompt": prompt})).json()
        bare = await http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})
        chat = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
        open_turn = await http.post(
            "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
        )
    assert done["tokens"] == hf_tokenizer.encode(prompt)
    assert done["count"] == len(done["tokens"])
    assert done["max_model_len"] == card["max_model_len"]
    assert bare.json()["tokens"] == hf_tokenizer.encode(prompt, add_special_tokens=False)
    template = partial(hf_tokenizer.apply_chat_template, MESSAGES, return_dict=False)
    assert chat["tokens"] == template(add_generation_prompt=True)
    assert open_turn.json()["tokens"] == template(add_generation_prompt=False) != chat["tokens"]
    reply = await api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]  # what generation counts


async def test_detokenize_agrees_with_the_model_tokenizer(served, hf_tokenizer):  # noqa: F811
    ids = hf_tokenizer.encode("Blocks of sixteen tokens")
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        done = await http.post("/detokenize", json={"tokens": ids})
        bad = await http.post("/detokenize", json={"tokens": [len(hf_tokenizer) + 10**6]})
        neither = await http.post("/tokenize", json={})
    assert done.json() == {"prompt": hf_tokenizer.decode(ids)}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"


async def test_version_and_one_model(served, api, model, tiny_llama):  # noqa: F811
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        version = (await http.get("/version")).json()
        by_path = (await http.get(f"/v1/models/{tiny_llama}")).json()
    assert version == {"version": "0.1.0"}
    one = await api.models.retrieve(model)
    assert one.id == model == by_path["id"] and one.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        await api.models.retrieve("no-such-model")
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
