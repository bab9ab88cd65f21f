"""flush_sent over a real nats-server: a subscription made on one connection answers a request
from another right after it, every time."""

import nats
import nats.errors
from kvpager.services.connection import flush_sent

ROUNDS = 2000  # with nats-py's plain flush(), 1-9 of them got "no responders" (3 of 3 runs failed)


async def test_a_flushed_subscription_answers_the_next_request_from_another_connection(
    nats_server,
):
    requester = await nats.connect(nats_server.url)
    responder = await nats.connect(nats_server.url)

    async def answer(msg) -> None:
        await msg.respond(b"here")

    no_responders = 0
    try:
        for i in range(ROUNDS):
            sub = await responder.subscribe(f"flushtest.{i}", cb=answer)
            await flush_sent(responder)
            try:
                assert (await requester.request(f"flushtest.{i}", timeout=2)).data == b"here"
            except nats.errors.NoRespondersError:
                no_responders += 1
            await sub.unsubscribe()
    finally:
        await requester.close()
        await responder.close()
    assert no_responders == 0
