"""The gateway's response store: its bounds (entries, bytes, time to live) and its owners."""

import msgspec
from kvpager.schemas.openai import Message
from kvpager.services.http.response_store import ResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stored(text: str) -> StoredResponse:
    return StoredResponse({"id": text}, [Message(role="user", content=text)])


async def test_the_oldest_go_first_past_the_entries_bound():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20, ttl_s=60)
    for name in ("a", "b", "c"):
        assert await store.put("k", name, _stored(name))
    assert await store.get("k", "a") is None
    assert await store.get("k", "b") == _stored("b") and await store.get("k", "c") == _stored("c")
    assert len(store) == 2


async def test_the_oldest_go_first_past_the_bytes_bound():
    size = len(msgspec.json.encode(_stored("x" * 100)))
    store = ResponseStore(max_entries=100, max_bytes=2 * size + 1, ttl_s=60)
    for name in ("a", "b", "c"):
        await store.put("k", name, _stored(name * 100))
    assert [await store.get("k", name) is None for name in "abc"] == [True, False, False]
    assert store.num_bytes == 2 * size
    assert not await store.put("k", "d", _stored("d" * 1000))  # alone over the bound: not kept
    assert await store.get("k", "d") is None and store.num_bytes == 2 * size


async def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=10, clock=clock)
    await store.put("k", "a", _stored("a"))
    clock.now = 5.0
    await store.put("k", "b", _stored("b"))
    clock.now = 10.0
    assert await store.get("k", "a") is None and await store.get("k", "b") is not None
    clock.now = 15.0
    assert await store.get("k", "b") is None and len(store) == 0 and store.num_bytes == 0


async def test_another_owner_finds_nothing_and_deletes_nothing():
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=60)
    await store.put("alpha", "a", _stored("a"))
    assert await store.get("beta", "a") is None and not await store.delete("beta", "a")
    assert await store.get("alpha", "a") is not None
    assert await store.delete("alpha", "a") and await store.get("alpha", "a") is None
    assert not await store.delete("alpha", "a") and store.num_bytes == 0


async def test_one_owner_cannot_push_the_others_out():
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=60, max_per_owner=2)
    await store.put("beta", "b0", _stored("b0"))
    for i in range(5):
        await store.put("alpha", f"a{i}", _stored(f"a{i}"))
    assert [await store.get("alpha", f"a{i}") is not None for i in range(5)] == [False] * 3 + [
        True
    ] * 2
    assert await store.get("beta", "b0") is not None and len(store) == 3
    assert (
        await store.delete("beta", "b0")
        and await store.delete("alpha", "a4")
        and await store.delete("alpha", "a3")
    )
    assert len(store) == 0 and store.num_bytes == 0 and not store._by_owner
