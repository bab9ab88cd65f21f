"""Which instance (scheduler + executor pair) runs a request: kv, least-loaded or round-robin.

No NATS here: the tokenizer service feeds the router what discovery and KV events say, and
asks it for an instance per request.

kv (Dynamo's cost): overlap_weight x blocks to prefill + decode blocks, the lowest wins.
  blocks to prefill = the request's blocks - the leading blocks the instance already caches
  (from its KV events, plus blocks of requests this router sent it lately, which its events
  have not confirmed yet: a burst of one prompt's users then stays together);
  blocks on the instance's disk tier right after that cached prefix count as disk_hit_cost of
  a block to prefill (a read back through the CPU pool: cheaper than computing, dearer than
  a device hit);
  decode blocks = blocks in use there once the request runs too: the instance's own count,
  or what this router has in flight on it (distinct blocks, plus one a request), whichever is
  larger, plus the request's blocks not already among them (Dynamo's potential blocks), plus
  the free blocks that pinned prefixes hold there (GenerateRequest.cache: evicted only after
  every other free block, so memory a request cannot count on) less those it would read.
least-loaded: fewest requests running and waiting, then fewest decode blocks.
round-robin: every instance in turn.

Disaggregation (docs/user/disaggregation.md): instances have roles. A new request goes to a
prefill instance (role "prefill" or "both"), by the router's mode; a stream a prefill instance
handed on goes to a decode instance (role "decode" or "both") with the fewest requests, then
decode blocks: its prompt's blocks arrive with it, so prefix overlap saves nothing there.
With no instance of the role up, any instance serves (it computes what it must).
"""

import itertools
import time
from dataclasses import dataclass, field

from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.engine.router.kv_index import KvIndex
from kvpager.schemas.errors import ConfigError, ModelNotFoundError, NoInstanceError
from kvpager.schemas.tokenizer import InstanceLoad, KvEvents

ROUTERS = ("kv", "least-loaded", "round-robin")
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "kv"
    ttl_s: float = 10.0  # an instance not heard from for this long is gone
    # Dynamo's default is 1. Here a cached prompt block saves a block of prefill (16 tokens
    # through every layer) while a block in use costs each decode step one block of K/V reads:
    # at 1, one extra request in flight (~20 blocks) outweighed a 256-token system prompt's
    # 16 cached blocks, and a steady stream of 8 system prompts spread over both instances
    # as round-robin's did (benchmarks/replicas.py at 2.5 req/s: prefix hits 0.755, the same
    # as round-robin's; at 4: 0.795-0.802 of an ideal 0.809; TTFT at that light load was
    # within run-to-run noise of round-robin's either way).
    overlap_weight: float = 4.0
    predict_s: float = 5.0  # how long a routed request's blocks count as cached there
    # a block on an instance's disk tier, as a fraction of a block to prefill: a read of one
    # SmolLM2 block (737 kB) from the page cache takes well under a millisecond, computing
    # its 16 tokens a few; 0.5 is cautious about cold disks, and keeps it between 0 and 1
    disk_hit_cost: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in ROUTERS:
            raise ConfigError(f"router: {self.mode!r} is not one of {', '.join(ROUTERS)}")
        if not 0.0 <= self.disk_hit_cost <= 1.0:
            raise ConfigError("router: disk_hit_cost must be in [0, 1]")
        if self.ttl_s <= 0 or self.predict_s < 0 or self.overlap_weight < 0:
            raise ConfigError("router: ttl and weights must be positive")


@dataclass
class Instance:
    name: str
    load: InstanceLoad
    last_seen: float
    in_flight: dict[str, list[bytes]] = field(default_factory=dict)  # request id -> hashes
    predicted: dict[bytes, float] = field(default_factory=dict)  # hash -> expiry

    @property
    def decode_blocks(self) -> int:
        """Blocks in use: the instance's count, or this router's requests there (distinct
        full blocks, plus a tail block each), whichever is larger."""
        own = len(set(itertools.chain.from_iterable(self.in_flight.values())))
        return max(self.load.num_used_blocks, own + len(self.in_flight))

    def potential_blocks(self, hashes: list[bytes]) -> int:
        """Blocks in use once the request runs here too: shared blocks count once."""
        active = set(itertools.chain.from_iterable(self.in_flight.values()))
        return self.decode_blocks + len(set(hashes) - active) + 1

    @property
    def num_requests(self) -> int:
        return max(self.load.num_running + self.load.num_waiting, len(self.in_flight))


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.instances: dict[str, Instance] = {}
        self.index = KvIndex()
        self._turn = 0
        self._where: dict[str, str] = {}  # request id -> instance

    # --- what discovery and events say ---------------------------------------------------

    def observe(self, name: str, load: InstanceLoad, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        instance = self.instances.get(name)
        if instance is None:
            self.instances[name] = Instance(name, load, now)
        else:
            instance.load, instance.last_seen = load, now

    def apply(self, batch: KvEvents, now: float | None = None) -> None:
        self.index.apply(batch)
        self.observe(batch.instance, batch.load, now)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop instances not heard from within the TTL; their names."""
        now = time.monotonic() if now is None else now
        gone = [n for n, i in self.instances.items() if now - i.last_seen > self.config.ttl_s]
        for name in gone:
            self.drop(name)
        return gone

    def drop(self, name: str) -> None:
        """The instance is gone (its TTL passed, or it failed a request)."""
        self.instances.pop(name, None)
        self.index.forget(name)

    # --- choosing --------------------------------------------------------------------------

    def pick(
        self,
        token_ids: list[int],
        model: str | None = None,
        exclude: frozenset[str] = frozenset(),
        phase: str = "prefill",
    ) -> str:
        """The instance for a request (`phase` "decode": a stream handed on with its blocks);
        raises NoInstanceError or ModelNotFoundError."""
        candidates = self._for_phase(self._candidates(model, exclude), phase)
        if phase == "decode":
            return min(candidates, key=lambda i: (i.num_requests, i.decode_blocks, i.name)).name
        if self.config.mode == "round-robin":
            self._turn += 1
            return candidates[self._turn % len(candidates)].name
        if self.config.mode == "least-loaded":
            return min(candidates, key=lambda i: (i.num_requests, i.decode_blocks, i.name)).name
        costs = self.costs(candidates, token_ids)
        return min(candidates, key=lambda i: (costs[i.name], len(i.in_flight))).name

    def _candidates(self, model: str | None, exclude: frozenset[str]) -> list[Instance]:
        serving = [i for i in self.instances.values() if i.load.model]
        if model is not None and serving and not any(i.load.model == model for i in serving):
            served = sorted({i.load.model for i in serving})
            raise ModelNotFoundError(f"no instance serves model {model!r} (served: {served})")
        candidates = sorted(
            (i for i in serving if i.name not in exclude and model in (None, i.load.model)),
            key=lambda i: i.name,
        )
        if not candidates:  # none has an executor: one of them says so, with its own error
            candidates = sorted(
                (i for i in self.instances.values() if i.name not in exclude), key=lambda i: i.name
            )
        if not candidates:
            raise NoInstanceError("no instance is up to take the request; retry soon")
        return candidates

    @staticmethod
    def _for_phase(candidates: list[Instance], phase: str) -> list[Instance]:
        """The candidates whose role does `phase`; all of them when none does."""
        fit = [i for i in candidates if i.load.role in (phase, "both")]
        return fit or candidates

    def costs(self, instances: list[Instance], token_ids: list[int]) -> dict[str, float]:
        """Dynamo's cost of running the request on each instance."""
        costs = {i.name: float("inf") for i in instances if not i.load.block_size}
        for block_size in {i.load.block_size for i in instances} - {0}:
            hashes = prompt_block_hashes(token_ids, block_size)
            num_blocks = -(-len(token_ids) // block_size)
            overlaps = self.index.overlaps(hashes)
            for instance in (i for i in instances if i.load.block_size == block_size):
                overlap = self._predicted_overlap(instance, hashes, overlaps.get(instance.name, 0))
                on_disk = self.index.disk_run(instance.name, hashes, overlap)
                to_prefill = num_blocks - overlap - (1 - self.config.disk_hit_cost) * on_disk
                prefill = self.config.overlap_weight * to_prefill
                held = self._held_by_pins(instance, hashes)
                costs[instance.name] = prefill + instance.potential_blocks(hashes) + held
        return costs

    def _held_by_pins(self, instance: Instance, hashes: list[bytes]) -> int:
        """Free blocks pins hold on the instance, less the request's own pinned prefix."""
        own = self.index.num_pinned(instance.name, hashes, time.time())
        return max(0, instance.load.num_pinned_free_blocks - own)

    def _predicted_overlap(self, instance: Instance, hashes: list[bytes], known: int) -> int:
        """The known overlap, extended by blocks of requests routed there lately."""
        cached = self.index.by_instance.get(instance.name, set())
        now = time.monotonic()
        for depth in range(known, len(hashes)):
            block_hash = hashes[depth]
            if block_hash not in cached and instance.predicted.get(block_hash, 0.0) < now:
                return depth
        return len(hashes)

    # --- requests in flight ------------------------------------------------------------------

    def routed(self, request_id: str, name: str, token_ids: list[int]) -> None:
        """`request_id` went to `name`: its blocks count there until released."""
        instance = self.instances.get(name)
        if instance is None:
            return
        self.release(request_id)
        block_size = instance.load.block_size
        hashes = prompt_block_hashes(token_ids, block_size) if block_size else []
        instance.in_flight[request_id] = hashes
        expiry = time.monotonic() + self.config.predict_s
        instance.predicted.update(dict.fromkeys(hashes, expiry))
        self._where[request_id] = name

    def release(self, request_id: str) -> None:
        name = self._where.pop(request_id, None)
        instance = self.instances.get(name) if name is not None else None
        if instance is not None:
            instance.in_flight.pop(request_id, None)
            now = time.monotonic()
            instance.predicted = {h: t for h, t in instance.predicted.items() if t >= now}
