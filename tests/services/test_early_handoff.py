"""A stream handed on before the add's answer reached the tokenizer. An instance's deltas and
its answer to the AddRequest come on two subscriptions, in no set order: a prefill instance
whose prompt is all cached computes the first token and hands the stream on within a
millisecond, and a drain can come as quickly. The tokenizer used to drop such a handoff (the
stream was "not submitted" yet), and the stream hung until the client gave up (seen once in a
loaded run of test_disaggregation). Here the test is the instance's scheduler, on a real NATS
server, and sends the handoff before its answer."""

import asyncio

import msgspec
import nats
import pytest
from kvpager.engine.core import DRAINED, PREFILLED
from kvpager.schemas.kv_transfer import KvHandoff
from kvpager.schemas.scheduler import AddRequest, FinishRequest, PromptPiece, SchedulerInfo
from kvpager.schemas.tokenizer import AddResult, SampleDelta, TokenBatch
from kvpager.services.client import Client
from kvpager.services.connection import flush_sent
from kvpager.services.subjects import Subjects
from kvpager.services.wire import pack

from tests.services.conftest import start_services
from tests.services.test_cli_flags import _refused

PREFIX, INSTANCE = "early", "default"  # the tokenizer's own instance: no discovery needed
_requests = msgspec.msgpack.Decoder(AddRequest | FinishRequest | PromptPiece)


class Instance:
    """The scheduler of instance `default`, as the tokenizer sees it over NATS."""

    def __init__(self, nc, prefilled: bool) -> None:
        self.nc, self.prefilled = nc, prefilled
        self.adds: list[AddRequest] = []
        self.handoff: KvHandoff | None = None

    async def start(self) -> None:
        subjects = Subjects(PREFIX).for_instance(INSTANCE)
        await self.nc.subscribe(subjects.scheduler_requests, cb=self._on_request)
        await self.nc.subscribe(subjects.scheduler_info, cb=self._on_info)
        await flush_sent(self.nc)  # the server has both SUBs (nc.flush() does not promise it)

    async def _on_info(self, msg) -> None:
        await msg.respond(pack(SchedulerInfo(True, "tiny", 1024, 512, "sched-1", "exec-1")))

    async def _on_request(self, msg) -> None:
        request = _requests.decode(msg.data)
        if not isinstance(request, AddRequest):
            return  # aborts and dropped holds: nothing runs here
        self.adds.append(request)
        if len(self.adds) == 1:  # the first token and the handoff, then the answer
            await self._hand_on(request)
            await asyncio.sleep(0.3)
            await msg.respond(pack(AddResult(scheduler_id="sched-1")))
        else:  # the continuation: the rest of the stream
            await msg.respond(pack(AddResult(scheduler_id="sched-1")))
            last = SampleDelta(request.request_id, token_ids=[8], finish_reason="length")
            await self.nc.publish(request.reply_to, pack(TokenBatch(2, [last])))

    async def _hand_on(self, add: AddRequest) -> None:
        why = PREFILLED if self.prefilled else DRAINED
        num_tokens = len(add.prompt_token_ids) + 1
        self.handoff = KvHandoff("t" * 32, INSTANCE, "agent", [[0]], num_tokens, self.prefilled)
        first = SampleDelta(add.request_id, token_ids=[7])
        final = SampleDelta(
            add.request_id, finish_reason="error", error=why, kv_handoff=self.handoff
        )
        await self.nc.publish(add.reply_to, pack(TokenBatch(1, [first, final])))
        await self.nc.flush()


@pytest.mark.parametrize("prefilled", [True, False], ids=["prefill-handoff", "drain"])
async def test_a_handoff_before_the_adds_answer_is_not_lost(
    nats_server, tiny_llama, tmp_path, prefilled
):
    services = start_services(nats_server.url, tiny_llama, tmp_path, PREFIX, ("tokenizer",))
    nc = await nats.connect(nats_server.url)
    instance = Instance(nc, prefilled)
    await instance.start()
    client = await Client.connect(nats_server.url, PREFIX)
    try:
        fields = dict(prompt_token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)
        events = await asyncio.wait_for(_refused(client, fields), 60.0)
    finally:
        await client.close()
        await nc.close()
        services.stop()
    tokens = [t for event in events for t in event.token_ids]
    if prefilled:  # no decode instance: back to the prefill one, which reads its own blocks
        assert [event.error for event in events] == [None] * len(events), events
        assert tokens == [7, 8] and events[-1].finish_reason == "length", events
        continuation = instance.adds[1]
        assert continuation.kv_source == instance.handoff, continuation
        assert continuation.prompt_token_ids[-1] == 7, continuation
    else:  # a drain with no other instance: the stream ends with why it moved, at once
        assert tokens == [7] and events[-1].error == DRAINED, events
        assert len(instance.adds) == 1, instance.adds
