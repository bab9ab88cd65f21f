"""The scheduler's Outbox routes the engine core's SampleDeltas: a request's route lasts while
the core's SampleDeltas keep it open, and goes with the batch that closes it."""

import msgspec
import nats
from kvpager.engine.sched.sample_deltas import SampleDeltas
from kvpager.schemas.scheduler import TokenLogprobs
from kvpager.schemas.tokenizer import SampleDelta, TokenBatch
from kvpager.services.scheduler.outbox import Outbox

from tests.nats_server import NatsServer


def test_a_route_lasts_until_the_batch_with_the_last_final_delta():
    closed: list[str] = []
    deltas = SampleDeltas(on_close=closed.append)
    outbox = Outbox(nc=None)  # routing publishes nothing
    for request_id, subject in (("two", "tokens.a"), ("one", "tokens.b")):
        outbox.routes[request_id] = subject
    deltas.track("two", 2)
    deltas.track("one", 1)

    deltas.add_finals("two", "stop", indices=[0])  # sample 1 of "two" is still running
    batches = outbox.route(deltas.take(), deltas.open.__contains__)
    assert [(d.index, d.finish_reason) for d in batches["tokens.a"]] == [(0, "stop")]
    assert set(outbox.routes) == {"two", "one"} and closed == []

    deltas.add_finals("one", "abort")  # both remaining finals in one batch
    deltas.add_finals("two", "length")
    batches = outbox.route(deltas.take(), deltas.open.__contains__)
    assert [(d.request_id, d.index) for d in batches["tokens.a"]] == [("two", 1)]
    assert [(d.request_id, d.index) for d in batches["tokens.b"]] == [("one", 0)]
    assert outbox.routes == {} and sorted(closed) == ["one", "two"]


def test_one_batch_with_every_final_of_a_request_routes_them_all():
    deltas = SampleDeltas(on_close=lambda _: None)
    outbox = Outbox(nc=None)
    outbox.routes["r"] = "tokens.a"
    deltas.track("r", 3)
    deltas.add_finals("r", "abort")  # all three samples' finals: the route ends after the third
    batches = outbox.route(deltas.take(), deltas.open.__contains__)
    assert [d.index for d in batches["tokens.a"]] == [0, 1, 2]
    assert outbox.routes == {}
    assert outbox.route([], deltas.open.__contains__) == {}


async def test_deltas_over_the_wire_limit_fail_their_request_alone(tmp_path):
    """A 16 KiB server: many deltas go in several TokenBatches; one delta that cannot fit
    even alone becomes an error delta for its request, and only that request is reported."""
    config = tmp_path / "nats.conf"
    config.write_text("max_payload: 16384\n")
    server = NatsServer(extra_args=("-c", str(config)))
    nc = await nats.connect(server.url)
    try:
        sub = await nc.subscribe("tokens.a")
        outbox = Outbox(nc)
        many = [SampleDelta(f"r{i}", token_ids=list(range(300))) for i in range(40)]
        huge = TokenLogprobs(-0.5, list(range(20)), [-1.0] * 20)
        big = SampleDelta("big", token_ids=[1] * 2000, logprobs=[huge] * 2000)
        failed = await outbox.publish({"tokens.a": [*many, big]}, step_id=3)
        assert failed == {"big"}
        batches = [TokenBatch(-1, [])]
        while sum(len(b.deltas) for b in batches) < len(many) + 1:
            msg = await sub.next_msg(timeout=5)
            batches.append(msgspec.msgpack.decode(msg.data, type=TokenBatch))
        deltas = [d for b in batches[1:] for d in b.deltas]
        assert len(batches) > 3 and all(b.step_id == 3 for b in batches[1:])
        assert deltas[:-1] == many
        assert deltas[-1].finish_reason == "error" and deltas[-1].request_id == "big"
    finally:
        await nc.close()
        server.stop()
