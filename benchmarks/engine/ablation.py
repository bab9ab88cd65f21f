"""Ablation: paging versus contiguous per-request reservation, at the same KV memory budget.

Systems before PagedAttention (FasterTransformer, Orca) stored each request's K/V in one
contiguous region reserved when the request is admitted, sized for the longest it may grow.
`ContiguousBlockManager` reproduces that inside kvpager: on a request's first allocation it
takes every block of its reservation at once (`max_model_len` tokens, or `prompt + max_tokens`
in the "oracle" variant that knows each output length in advance); later steps then never
allocate. Everything else (model, executor, scheduler, token budget, block size) is the same
engine, so the difference in concurrency and throughput comes from the reservation alone.

Honesty notes: blocks of one reservation need not be adjacent in memory here; contiguity
itself costs nothing on top (a real contiguous allocator would add external fragmentation, so
this baseline flatters contiguous reservation). Prefix caching is off in every arm, and only
n = 1 workloads run (a fork would share the reserved, still empty blocks). Paging runs twice:
preempted requests recompute, or park in a CPU block pool (the engine's default on a CPU
device: a quarter of the KV budget, extra host memory the contiguous arms never need since they
never preempt).
"""

import gc
from collections.abc import Callable

from kvpager.engine.kv.block_manager import BlockManager, CachedBlock
from kvpager.engine.request import Request
from kvpager.services.bench.metrics import EngineResult
from kvpager.services.bench.offline import warm_up
from kvpager.services.bench.workloads import Workload

from benchmarks.common.config import BenchConfig
from benchmarks.common.machine import CpuWatch, wait_for_quiet
from benchmarks.engine.kvpager_offline import build_llm, drive


class ContiguousBlockManager(BlockManager):
    """Takes a request's whole reservation (`reserve(request)` tokens) at its first allocation."""

    def __init__(self, num_blocks: int, block_size: int, reserve: Callable[[Request], int]):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.reserve = reserve

    def _with_reservation(self, request: Request, num_new_tokens: int, hits) -> int:
        if request.seq_id in self.block_tables:
            return num_new_tokens  # reserved at admission already
        held = request.num_computed_tokens + len(hits) * self.block_size
        return max(num_new_tokens, self.reserve(request) - held)

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, hits: list[CachedBlock] = ()
    ) -> int:
        num_tokens = self._with_reservation(request, num_new_tokens, hits)
        return super().num_blocks_needed(request, num_tokens, hits)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hits: list[CachedBlock] = ()
    ) -> list[int] | None:
        num_tokens = self._with_reservation(request, num_new_tokens, hits)
        return super().allocate_slots(request, num_tokens, hits)


def ablation_blocks(workload: Workload, cfg: BenchConfig, fraction: float) -> int:
    """A budget of `fraction` of the blocks all requests need at full length, at least one
    max_model_len reservation."""
    bs = cfg.block_size
    full = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // bs) for r in workload.requests)
    return max(-(-cfg.max_model_len // bs), int(fraction * full))


ManagerFactory = Callable[[], BlockManager]


def run_ablation(
    workload: Workload, cfg: BenchConfig, num_blocks: int, quiet_wait_s: float = 0.0
) -> list[EngineResult]:
    assert all(r.n == 1 for r in workload.requests), "the ablation runs n = 1 workloads only"
    llm = build_llm(cfg, num_blocks=num_blocks, enable_prefix_caching=False)
    num_cpu = llm.executor.num_cpu_blocks
    bs = cfg.block_size
    arms: dict[str, ManagerFactory] = {  # without a CPU pool, every preemption recomputes
        "paged, recompute preemption": lambda: BlockManager(num_blocks, bs, False, 0),
        f"paged, swap preemption ({num_cpu} CPU blocks)": lambda: BlockManager(
            num_blocks, bs, False, num_cpu
        ),
        **contiguous_arms(cfg, num_blocks),
    }
    return run_arms(llm, workload, cfg, arms, quiet_wait_s)


def contiguous_arms(cfg: BenchConfig, num_blocks: int) -> dict[str, ManagerFactory]:
    """The two pre-paging baselines: reserve prompt + max_tokens (an oracle that knows each
    output length), or max_model_len, at admission."""
    bs, max_len = cfg.block_size, cfg.max_model_len
    return {
        "contiguous, prompt + max_tokens (oracle)": lambda: ContiguousBlockManager(
            num_blocks, bs, lambda r: r.max_num_tokens
        ),
        f"contiguous, max_model_len {max_len}": lambda: ContiguousBlockManager(
            num_blocks, bs, lambda r: max_len
        ),
    }


def run_arms(
    llm, workload: Workload, cfg: BenchConfig, arms: dict[str, ManagerFactory], quiet_wait_s=0.0
) -> list[EngineResult]:
    """The workload once per arm, on one engine whose scheduler gets the arm's block manager
    (same model, executor, token budget); block accounting checked after each."""
    warm_up(llm)
    results = []
    for name, make_manager in arms.items():
        scheduler = llm.scheduler
        assert not scheduler.has_unfinished and not scheduler.block_manager.num_used_blocks
        scheduler.block_manager = make_manager()
        print(f"[ablation] {name}: {scheduler.block_manager.num_blocks} blocks", flush=True)
        if quiet_wait_s:
            wait_for_quiet(quiet_wait_s)
        watch = CpuWatch()
        result = drive(llm, workload, f"ablation {name}", cfg.dtype)
        result.extra["other_cores"] = round(watch.other_cores(), 2)
        scheduler.check_invariants()
        result.extra["arm"] = name
        results.append(result)
    del llm
    gc.collect()
    return results
