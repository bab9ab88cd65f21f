"""OpenAI's Responses API (`/v1/responses`) through `kvpager serve --http-port` with the official
openai client, on a tiny random model: a response alone, retrieved and deleted; the greedy text
of the chat route for the same turns; a continued conversation served from the prefix cache;
streaming events; function calls; `store: false`; API key ownership; the store's bound; bad
input. Every test ends with all KV blocks free (the `nats_client` fixture)."""

import asyncio
import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.services.http_fixture import gateway, nats_client, served  # noqa: F401

INSTRUCTIONS = (
    "You are a terse assistant of the paged cache. Answer in few words, and name the block "
    "table, the slot mapping and the free list when they matter."
)
KEYS = ("key-alpha", "key-beta")
MAX_STORED, MAX_PER_KEY = 3, 2
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ANSWER = {  # a schema that ends the answer in a few tokens: the stream ends "completed"
    "type": "json_schema",
    "name": "answer",
    "schema": {
        "type": "object",
        "properties": {"size": {"enum": ["small", "large"]}},
        "required": ["size"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def keyed(served, tiny_llama, tmp_path_factory):  # noqa: F811
    """A gateway with two API keys and a store of MAX_STORED responses, MAX_PER_KEY a key."""
    env = {
        "KVPAGER_API_KEY": ",".join(KEYS),
        "KVPAGER_RESPONSES_MAX_STORED": str(MAX_STORED),
        "KVPAGER_RESPONSES_MAX_STORED_PER_KEY": str(MAX_PER_KEY),
    }
    with gateway(served, tiny_llama, tmp_path_factory.mktemp("keyed"), **env) as found:
        yield found


def _api(keyed, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=keyed.api_url, api_key=key, max_retries=0)


async def test_a_response_is_stored_retrieved_and_deleted(api, model, nats_client):  # noqa: F811
    done = await api.responses.create(
        model=model, input="Describe the cache.", max_output_tokens=6, temperature=0.0,
        metadata={"run": "7"},
    )  # fmt: skip
    assert done.id.startswith("resp_") and done.object == "response" and done.model == model
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    [item] = done.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text" and done.output_text == item.content[0].text
    usage = done.usage
    assert usage.output_tokens == 6 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and done.metadata == {"run": "7"}
    found = await api.responses.retrieve(done.id)
    assert found.model_dump() == done.model_dump()
    deleted = await api.responses.delete(done.id)
    assert deleted is None  # the SDK returns nothing; the body is checked raw below
    with pytest.raises(openai.NotFoundError) as caught:
        await api.responses.retrieve(done.id)
    assert caught.value.body["message"] == f"Response with id '{done.id}' not found."


async def test_delete_answers_openais_object(served, api, model, nats_client):  # noqa: F811
    done = await api.responses.create(model=model, input="Hi", max_output_tokens=2)
    async with httpx.AsyncClient(timeout=30) as http:
        deleted = await http.delete(f"{served.api_url}/responses/{done.id}")
        again = await http.delete(f"{served.api_url}/responses/{done.id}")
    assert deleted.json() == {"id": done.id, "object": "response", "deleted": True}
    assert again.status_code == 404 and again.json()["error"]["type"] == "invalid_request_error"


async def test_greedy_text_equals_the_chat_routes(api, model, nats_client):  # noqa: F811
    done = await api.responses.create(
        model=model, instructions=INSTRUCTIONS,
        input=[{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": "What is a block?"}]}],
        max_output_tokens=12, temperature=0.0,
    )  # fmt: skip
    chat = await api.chat.completions.create(
        model=model, max_tokens=12, temperature=0.0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is a block?"}],
    )  # fmt: skip
    assert done.output_text == chat.choices[0].message.content
    assert done.usage.input_tokens == chat.usage.prompt_tokens


async def test_a_continued_turn_reads_the_earlier_turns_from_the_cache(api, model, nats_client):  # noqa: F811
    first = await api.responses.create(
        model=model, instructions=INSTRUCTIONS, input="What is a block?", max_output_tokens=8,
        temperature=0.0,
    )  # fmt: skip
    second = await api.responses.create(
        model=model, instructions=INSTRUCTIONS, input="And a slot?", max_output_tokens=8,
        temperature=0.0, previous_response_id=first.id,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # the prompt held the earlier turn: the chat route, given every turn, says the same
    chat = await api.chat.completions.create(
        model=model, max_tokens=8, temperature=0.0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": "What is a block?"},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "And a slot?"}],
    )  # fmt: skip
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the first turn's prompt was cached by it, whole blocks of it read back by the second
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens - 16 < cached <= second.usage.input_tokens


async def test_a_stream_has_the_sdks_events(api, model, nats_client):  # noqa: F811
    stream = await api.responses.create(
        model=model, input="Is it small?", text={"format": ANSWER}, max_output_tokens=40,
        temperature=0.0, stream=True,
    )  # fmt: skip
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert json.loads(text)["size"] in ("small", "large")
    completed = events[-1].response
    assert completed.status == "completed" and completed.output_text == text
    assert completed.usage.output_tokens > 0
    assert (await api.responses.retrieve(completed.id)).output_text == text


class Size(pydantic.BaseModel):
    size: Literal["small", "large"]


async def test_the_sdks_stream_helper_parses_a_model(api, model, nats_client):  # noqa: F811
    """The SDK's own accumulator rebuilds the response from the events, and parses it."""
    async with api.responses.stream(
        model=model, input="Is it small?", text_format=Size, max_output_tokens=40,
        temperature=0.0,
    ) as stream:  # fmt: skip
        final = await stream.get_final_response()
    assert final.status == "completed" and final.output_parsed.size in ("small", "large")


async def test_a_named_tool_gives_a_function_call_and_takes_its_output(api, model, nats_client):  # noqa: F811
    done = await api.responses.create(
        model=model, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0,
    )  # fmt: skip
    [call] = done.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    answer = await api.responses.create(
        model=model, previous_response_id=done.id, tools=[WEATHER], tool_choice="none",
        max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}],
    )  # fmt: skip
    assert answer.output[0].type == "message"
    assert answer.usage.input_tokens_details.cached_tokens > 0


async def test_a_required_tool_streams_its_arguments(api, model, nats_client):  # noqa: F811
    stream = await api.responses.create(
        model=model, input="Weather?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=150, temperature=0.0, stream=True,
    )  # fmt: skip
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds, kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert set(json.loads(done.arguments)) == {"city", "unit"}
    assert kinds[-1] == "response.completed"
    calls = [item for item in events[-1].response.output if item.type == "function_call"]
    assert calls and calls[0].arguments == done.arguments and calls[0].name == "get_weather"


async def test_function_call_items_in_the_input(api, model, nats_client):  # noqa: F811
    """A client that keeps its own history sends earlier calls and their outputs back."""
    done = await api.responses.create(
        model=model, store=False, max_output_tokens=3, tools=[WEATHER], tool_choice="none",
        input=[{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Oslo", "unit": "celsius"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "12 C"}],
    )  # fmt: skip
    assert done.output[0].type == "message" and done.usage.output_tokens == 3


LONG_ASKS = ["Tell a long story.", "Write a poem about the sea.", "Describe a city at night."]


async def _running_stream(api, model, client):
    """A stream still generating after its first delta, and its events so far. Responses have
    no ignore_eos, and the tiny model may end an ask early at EOS: such a stream is read to its
    end and the next ask tried."""
    for ask in LONG_ASKS:
        stream = await api.responses.create(
            model=model, input=ask, max_output_tokens=800, temperature=0.0, stream=True
        )
        kinds = []
        async for event in stream:
            kinds.append(event.type)
            if kinds.count("response.output_text.delta") == 1:
                break
        if (await client.stats()).num_used_blocks > 0:
            return stream, kinds
        async for _ in stream:  # it ended already: nothing to abort
            pass
    pytest.fail("every ask ended before its first delta was read")


async def test_a_client_that_leaves_a_stream_aborts_it(api, model, nats_client):  # noqa: F811
    for _ in LONG_ASKS:
        before = (await nats_client.stats()).num_finished
        stream, kinds = await _running_stream(api, model, nats_client)
        await stream.close()
        for _ in range(100):
            stats = await nats_client.stats()
            if sum(stats.num_finished.values()) > sum(before.values()):
                if stats.num_used_blocks == 0:
                    break
            await asyncio.sleep(0.05)
        if stats.num_finished.get("abort", 0) == before.get("abort", 0) + 1:
            break
        # it ended on its own between the running check and the close: nothing was left to
        # abort, and another ask is tried; a stream that runs on after the close fails below
        assert stats.num_used_blocks == 0, stats
    assert stats.num_finished.get("abort", 0) == before.get("abort", 0) + 1, stats
    assert kinds[:2] == ["response.created", "response.in_progress"]


async def test_store_false_keeps_nothing(api, model, nats_client):  # noqa: F811
    done = await api.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    assert done.store is False
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(done.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await api.responses.create(
            model=model, input="Again", max_output_tokens=2, previous_response_id=done.id
        )
    assert caught.value.body["param"] == "previous_response_id"


async def test_another_key_cannot_read_continue_or_delete(keyed, tiny_llama, nats_client):  # noqa: F811
    model = tiny_llama.name
    async with _api(keyed, KEYS[0]) as alpha, _api(keyed, KEYS[1]) as beta:
        done = await alpha.responses.create(model=model, input="Mine", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await beta.responses.retrieve(done.id)
        with pytest.raises(openai.NotFoundError):
            await beta.responses.create(
                model=model, input="Yours?", max_output_tokens=2, previous_response_id=done.id
            )
        with pytest.raises(openai.NotFoundError):
            await beta.responses.delete(done.id)
        assert (await alpha.responses.retrieve(done.id)).id == done.id


async def test_the_store_keeps_the_newest_and_each_keys_share(keyed, tiny_llama, nats_client):  # noqa: F811
    async def made(api) -> str:
        done = await api.responses.create(model=tiny_llama.name, input="N", max_output_tokens=1)
        return done.id

    async def kept(api, response_id: str) -> bool:
        try:
            return (await api.responses.retrieve(response_id)).id == response_id
        except openai.NotFoundError:
            return False

    async with _api(keyed, KEYS[0]) as alpha, _api(keyed, KEYS[1]) as beta:
        first = await made(alpha)
        betas = [await made(beta) for _ in range(MAX_PER_KEY + 1)]  # past beta's share
        assert [await kept(beta, i) for i in betas] == [False] + [True] * MAX_PER_KEY
        assert await kept(alpha, first)  # beta's flood did not push alpha's out
        second = await made(alpha)  # past the store's bound: its oldest goes
        assert [await kept(alpha, first), await kept(alpha, second)] == [False, True]
        assert [await kept(beta, i) for i in betas[1:]] == [True] * MAX_PER_KEY


async def test_a_nats_store_without_jetstream_is_a_503(served, tiny_llama, tmp_path, nats_client):  # noqa: F811
    """The module's nats-server runs no JetStream: the store says so, and the answer stands."""
    with gateway(served, tiny_llama, tmp_path, KVPAGER_RESPONSES_STORE="nats") as found:
        async with _api(found, "-") as api:
            done = await api.responses.create(
                model=tiny_llama.name, input="Hi", max_output_tokens=2
            )
            assert done.status == "incomplete" and done.usage.output_tokens == 2
            with pytest.raises(openai.InternalServerError) as caught:
                await api.responses.retrieve(done.id)
    assert caught.value.status_code == 503 and "JetStream" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"background": True}, "background"),
        ({"modalities": ["text"]}, "modalities"),
        ({"input": "paged " * 400}, "input"),  # over the tokenizer's cap (400 tokens)
        ({"max_output_tokens": 5000}, "max_output_tokens"),  # over the cap (900)
    ],
)
async def test_bad_input_is_a_400_naming_the_field(served, model, fields, param, nats_client):  # noqa: F811
    body = {"model": model, "input": "Hi", **fields}
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(f"{served.api_url}/responses", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param, refused.json()
