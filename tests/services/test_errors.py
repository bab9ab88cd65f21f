"""Invalid requests get exactly one typed error event each; the services keep serving."""

import asyncio

import msgspec
import pytest
from kvpager.services.client import Client, NoKvpagerError
from kvpager.services.wire import MSGPACK_HEADERS

TOO_LONG = msgspec.json.encode({"prompt_token_ids": [5] * 1100})
INVALID = [  # (body, headers, error type, param)
    (b"", None, "invalid_request", None),
    (b"   ", None, "invalid_request", None),
    (b"{", None, "invalid_request", None),
    (b"[1, 2]", None, "invalid_request", None),
    (b"\xff\xfe", MSGPACK_HEADERS, "invalid_request", None),
    (b'{"prompt": 5}', None, "invalid_request", "prompt"),
    (b'{"prompt": "x", "max_tokens": "ten"}', None, "invalid_request", "max_tokens"),
    (b'{"prompt": "x", "colour": "red"}', None, "invalid_request", "colour"),
    (b'{"prompt": "x", "temperature": -1}', None, "invalid_request", "temperature"),
    (b'{"prompt": "x", "top_p": 0}', None, "invalid_request", "top_p"),
    (b'{"prompt": "x", "max_tokens": 0}', None, "invalid_request", "max_tokens"),
    (b'{"prompt": "x", "min_tokens": 9, "max_tokens": 2}', None, "invalid_request", "min_tokens"),
    (b'{"prompt": "x", "n": 0}', None, "invalid_request", "n"),
    (b'{"prompt": "x", "beam_width": 2, "temperature": 1}', None, "invalid_request", "temperature"),
    (b'{"prompt": "x", "stop": [""]}', None, "invalid_request", "stop"),
    (b"{}", None, "invalid_request", "prompt"),
    (b'{"prompt": ""}', None, "invalid_request", "prompt"),
    (b'{"prompt": "x", "prompt_token_ids": [1]}', None, "invalid_request", "prompt_token_ids"),
    (b'{"prompt_token_ids": [99999]}', None, "invalid_request", "prompt_token_ids"),
    (b'{"messages": [{"role": "user"}]}', None, "invalid_request", "messages"),
    (b'{"messages": []}', None, "invalid_request", "messages"),
    (b'{"prompt": "x", "max_tokens": 5000}', None, "request_too_long", "max_tokens"),
    # past the context length: refused by the tokenizer (its default --max-prompt-tokens),
    # naming the field sent
    (TOO_LONG, None, "request_too_long", "prompt_token_ids"),
]


async def _all_replies(client: Client, body: bytes, headers, wait_s: float = 0.5) -> list:
    """Every message on the reply subject until `wait_s` after the first final one."""
    inbox = client.nc.new_inbox()
    sub = await client.nc.subscribe(inbox)
    await client.nc.publish("llm.generate", body, reply=inbox, headers=headers)
    replies = []
    timeout = 10.0
    while True:
        try:
            msg = await sub.next_msg(timeout=timeout)
        except Exception:
            break
        msgpack = msg.headers and msg.headers.get("Content-Type") == "application/msgpack"
        replies.append((msgspec.msgpack if msgpack else msgspec.json).decode(msg.data))
        timeout = wait_s
    await sub.unsubscribe()
    return replies


async def test_each_invalid_request_gets_one_typed_error(client: Client):
    results = await asyncio.gather(
        *(_all_replies(client, body, headers) for body, headers, _, _ in INVALID)
    )
    for (body, _, error_type, param), replies in zip(INVALID, results):
        assert len(replies) == 1, (body[:60], replies)
        event = replies[0]
        assert event["finish_reason"] == "error" and event["usage"] is not None, event
        assert (event["error"]["type"], event["error"]["param"]) == (error_type, param), event
        assert event["seq"] == 0 and event["request_id"]
    events = [e async for e in client.generate(prompt="still serving", max_tokens=3)]
    assert events[-1].finish_reason == "length"


async def test_error_event_keeps_the_clients_request_id(client: Client):
    events = [e async for e in client.generate_raw(b'{"request_id": "mine", "top_k": -5}')]
    assert events[0].request_id == "mine" and events[0].error.param == "top_k"


async def test_duplicate_request_id_in_flight(client: Client):
    first = client.generate(request_id="twice", prompt="x", max_tokens=500, ignore_eos=True)
    assert (await anext(first)).seq == 0
    events = [e async for e in client.generate(request_id="twice", prompt="y")]
    assert events[0].error.type == "invalid_request" and events[0].error.param == "request_id"
    await first.aclose()  # aborts the first one


async def test_no_kvpager_listening(services):
    client = await Client.connect(services.url, prefix="nobody")
    try:
        with pytest.raises(NoKvpagerError):
            async for _ in client.generate(prompt="hello"):
                pass
        with pytest.raises(NoKvpagerError):
            await client.stats()
    finally:
        await client.close()


async def test_length_penalty_overflow_is_refused_and_others_finish(client: Client):
    """A public parameter that once overflowed inside the scheduler loop (and failed every stream
    in flight) is refused at the edge; the streams beside it end normally."""

    async def stream(prompt: str):
        return [e async for e in client.generate(prompt=prompt, max_tokens=24, ignore_eos=True)]

    running = [asyncio.ensure_future(stream(f"stream {i}")) for i in range(3)]
    bad = [
        e
        async for e in client.generate(
            prompt="x", beam_width=2, temperature=0.0, length_penalty=2000, max_tokens=8
        )
    ]
    assert bad[-1].error.type == "invalid_request" and bad[-1].error.param == "length_penalty"
    for events in await asyncio.gather(*running):
        assert events[-1].finish_reason == "length" and events[-1].error is None
        assert sum(len(e.token_ids) for e in events) == 24
