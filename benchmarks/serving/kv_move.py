"""Drain migration with blocks (issue #45, "Measure"): the time to move a stream with its KV
blocks to another engine against re-prefilling it there, and NIXL's transfer rate.

    python -m benchmarks.serving.kv_move                         # SmolLM2, prompts 512..4096
    python -m benchmarks.serving.kv_move --prompt-lens 64 --mib 8   # a smoke run

Per prompt length: engine A prefills the prompt and samples one token, then hands the stream
off (EngineCore.hand_off, as a drain does). Engine B admits the continuation twice, on fresh
caches: once with the handoff (its blocks read over NIXL, or the NATS fallback's
gather/scatter without NIXL, then one token computed), once without (the whole prompt
recomputed, as a crash's migration does). Reported: move = the transfer plus B's first
token; re-prefill = B's first token without the blocks. Both engines live in this process
(NIXL loopback over UCX), so the rate is a lower bound on a quiet host's; the `rate` figure
moves `--mib` MiB between two registered buffers the same way.
"""

import argparse
import asyncio
import json
import time

import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.core import EngineCore
from kvpager.engine.download import resolve_model
from kvpager.engine.frontend.migration import continuation
from kvpager.engine.request import Request
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.engine.worker.kv_transfer.endpoint import executor_regions
from kvpager.engine.worker.kv_transfer.regions import KvRegions

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class Engine:
    def __init__(self, path: str, num_blocks: int) -> None:
        self.llm = LLM(path, dtype="float32", block_size=16, num_blocks=num_blocks)
        self.deltas, self.pulls = [], []
        self.core = EngineCore(self.llm.scheduler, self, self._publish)

    async def submit(self, step) -> None:
        self.pulls += step.kv_pulls
        await self.llm.runner.submit(step)

    async def result(self, step_id: int):
        return await self.llm.runner.result(step_id)

    def cancel(self) -> None:
        self.llm.runner.cancel()

    async def _publish(self, deltas, step_id) -> None:
        self.deltas += deltas

    def run_until(self, done) -> float:
        async def loop() -> None:
            while not done():
                await self.core.run_step()
            while self.core.num_in_flight:
                self.core.paused = True
                await self.core.run_step()
            self.core.paused = False
            await self.core.publish()

        started = time.perf_counter()
        self.llm.run_async(loop())
        return time.perf_counter() - started

    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


def _move(path: str, prompt: list[int], num_blocks: int, use_nixl: bool) -> dict:
    source = Engine(path, num_blocks)
    source.core.add(Request("r", prompt, PARAMS))
    source.run_until(lambda: len(source.tokens()) >= 1)
    source.core.hand_off("a", "source", lambda r: True)
    source.llm.run_async(source.core.publish())
    handoff = next(d.kv_handoff for d in source.deltas if d.kv_handoff is not None)
    ids, params = continuation(prompt, source.tokens(), PARAMS)
    moved, recomputed = Engine(path, num_blocks), Engine(path, num_blocks)
    recomputed.core.add(Request("r", ids, params))
    prefill_s = recomputed.run_until(lambda: bool(recomputed.tokens()))
    moved.core.add(Request("r", ids, params, kv_import=handoff))
    moved.run_until(lambda: bool(moved.core.scheduler.importing))
    pull = moved.pulls[0]
    ours, theirs = (executor_regions(e.llm.runner.executor) for e in (moved, source))
    pair = _nixl_pair(theirs, ours) if use_nixl else None  # connected ahead, as executors are
    started = time.perf_counter()
    num_bytes = _pull(theirs, ours, pull, pair)
    transfer_s = time.perf_counter() - started
    if pair is not None:
        pair[0].close(), pair[1].close()
    moved.core.scheduler.pulled(pull.transfer_id, num_bytes, transfer_s, True)
    first_s = moved.run_until(lambda: bool(moved.tokens()))
    assert moved.tokens()[:1] == recomputed.tokens()[:1], "the moved stream diverged"
    return dict(
        prompt_len=len(prompt), num_bytes=num_bytes, transfer_ms=round(1e3 * transfer_s, 2),
        move_ms=round(1e3 * (transfer_s + first_s), 2), reprefill_ms=round(1e3 * prefill_s, 2),
    )  # fmt: skip


def _pull(theirs: KvRegions, ours: KvRegions, pull, pair) -> int:
    if pair is None:
        flat = [b for g in pull.remote for b in g], [b for g in pull.local for b in g]
        ours.scatter(flat[1], theirs.gather(flat[0]))
        return ours.num_bytes(len(flat[1]))
    return asyncio.run(pair[1].read("holder", pull.remote, pull.local, "t"))


def _nixl_pair(theirs: KvRegions, ours: KvRegions):
    """A holder and a reader agent, the reader connected to the holder."""
    holder = nixl.NixlTransfer(theirs, "holder", "a")
    reader = nixl.NixlTransfer(ours, "reader", "b")
    reader.add_peer(holder.agent())
    return holder, reader


def _rate(mib: int) -> dict:
    """NIXL moving `mib` MiB between two registered buffers (one region a 1 MiB block)."""
    shape = (1, 1, mib, 1024 * 1024)
    a, b = torch.randint(0, 255, shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    ra, rb = KvRegions(a, "bench", []), KvRegions(b, "bench", [])
    blocks = list(range(mib))
    holder, reader = _nixl_pair(ra, rb)
    asyncio.run(reader.read("holder", [blocks[:1]], [blocks[:1]], "warm"))
    started = time.perf_counter()
    asyncio.run(reader.read("holder", [blocks], [blocks], "rate"))
    seconds = time.perf_counter() - started
    reader.close(), holder.close()
    assert torch.equal(a, b)
    return dict(mib=mib, seconds=round(seconds, 4), gb_per_s=round(mib / 1024 / seconds, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-lens", default="512,1024,2048,4096")
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    use_nixl = nixl.available()
    results = {"transfer": "nixl" if use_nixl else "bytes (NATS fallback's path, no NATS)"}
    if use_nixl:
        results["rate"] = _rate(args.mib)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    num_blocks = max(lens) // 16 + 8
    results["streams"] = [_move(path, list(range(3, 3 + n)), num_blocks, use_nixl) for n in lens]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
