"""The scheduler's Outbox routes the engine core's SampleDeltas: a request's route lasts while
the core's SampleDeltas keep it open, and goes with the batch that closes it."""

from engine.sched.sample_deltas import SampleDeltas
from services.scheduler.outbox import Outbox


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
