"""Prometheus metrics of every instance, read from `llm.stats` at scrape time.

One `llm.stats` request reaches every scheduler (each instance's subscription hears it); the
answers that come within the timeout are gathered (after the first, each waits `GRACE_S` for
more) and exposed by a prometheus_client Collector, labelled `engine` (the instance; vLLM's
label: Prometheus itself sets `instance` to the scraped target). Names follow vLLM's.
"""

import time
from collections.abc import Iterator

import msgspec
import nats.errors
import structlog
from kvpager.schemas.public import Histogram, Stats
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

log = structlog.get_logger(__name__)

GRACE_S = 0.1
LABELS = ["engine"]
GAUGES = {  # name: (help, value of a Stats)
    "num_requests_running": ("requests running", lambda s: s.num_running),
    "num_requests_waiting": ("requests waiting", lambda s: s.num_waiting),
    "kv_cache_usage_perc": (
        "fraction of KV blocks in use (1 = full)",
        lambda s: s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0,
    ),
    "num_blocks": ("KV blocks in all", lambda s: s.num_blocks),
    "num_free_blocks": ("KV blocks free", lambda s: s.num_free_blocks),
    "num_cached_blocks": (
        "free KV blocks holding prefix-cache data",
        lambda s: s.num_cached_blocks,
    ),
    "num_pinned_blocks": (
        "KV blocks pinned by requests' cache (a prefix kept for its TTL)",
        lambda s: s.num_pinned_blocks,
    ),
    "kv_transfer_mean_seconds": (
        "mean time of a KV transfer from another instance",
        lambda s: s.kv_transfer_mean_ms / 1000,
    ),
}
COUNTERS = {
    "num_preemptions": ("preemptions", lambda s: s.num_preemptions),
    "num_swap_preemptions": (
        "preemptions that swapped blocks to host memory",
        lambda s: s.num_swap_preemptions,
    ),
    "prefix_cache_queries": (
        "prompt tokens looked up in the prefix cache",
        lambda s: s.prefix_cache_queried_tokens,
    ),
    "prefix_cache_hits": (
        "prompt tokens served by the prefix cache",
        lambda s: s.prefix_cache_hit_tokens,
    ),
    "num_pinned_evictions": (
        "pinned KV blocks evicted under pressure (demoted to CPU, or dropped)",
        lambda s: s.num_pinned_evictions,
    ),
    "prompt_tokens": ("prompt tokens of scheduled requests", lambda s: s.num_prompt_tokens),
    "generation_tokens": ("generated tokens", lambda s: s.num_generated_tokens),
    "engine_steps": ("model steps", lambda s: s.num_steps),
    # drain migration with blocks (docs/user/replicas.md)
    "kv_transfer_blocks": ("KV blocks read from another instance", lambda s: s.kv_transfer_blocks),
    "kv_transfer_bytes": ("their bytes", lambda s: s.kv_transfer_bytes),
    "kv_transfer_failed": (
        "KV transfers that failed (the stream recomputed)",
        lambda s: s.kv_transfer_failed,
    ),
    "kv_handoffs": ("streams handed on with their KV blocks", lambda s: s.kv_handoffs),
    # vLLM's speculative-decoding counters: acceptance rate = accepted / draft tokens, mean
    # accepted length = 1 + accepted / drafts
    "spec_decode_num_drafts": (
        "sequences whose proposed tokens a step verified",
        lambda s: s.spec_decode_num_drafts,
    ),
    "spec_decode_num_draft_tokens": (
        "proposed tokens verified",
        lambda s: s.spec_decode_num_draft_tokens,
    ),
    "spec_decode_num_accepted_tokens": (
        "proposed tokens accepted",
        lambda s: s.spec_decode_num_accepted_tokens,
    ),
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("arrival at the scheduler to the first token", "ttft_s"),
    "inter_token_latency_seconds": ("between two tokens of a request", "itl_s"),
    "e2e_request_latency_seconds": ("arrival at the scheduler to the end", "e2e_s"),
    "request_queue_time_seconds": ("arrival at the scheduler to first scheduled", "queue_s"),
}


async def gather_stats(nc: NATS, subject: str, timeout_s: float) -> list[Stats]:
    """Every instance's Stats that answer within `timeout_s`, by instance name."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: dict[str, Stats] = {}
    try:
        await nc.publish(subject, b"", reply=inbox)
        deadline = time.monotonic() + timeout_s
        wait_s = timeout_s
        while wait_s > 0:
            try:
                msg = await sub.next_msg(timeout=wait_s)
            except nats.errors.TimeoutError:
                break
            if (msg.headers or {}).get("Status") == "503":
                break  # no responders: no scheduler runs
            _add(found, msg.data)
            wait_s = min(GRACE_S, deadline - time.monotonic())
    finally:
        await sub.unsubscribe()
    return [found[name] for name in sorted(found)]


def _add(found: dict[str, Stats], data: bytes) -> None:
    try:
        stats = msgspec.json.decode(data, type=Stats)
    except msgspec.MsgspecError as exc:  # a scheduler of another version
        log.warning("unreadable llm.stats answer", error=str(exc))
        return
    found[stats.instance] = stats


class StatsCollector:
    """The metric families of a set of Stats, one sample per instance."""

    def __init__(self, stats: list[Stats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        for name, (text, value) in GAUGES.items():
            family = GaugeMetricFamily(f"kvpager:{name}", text, labels=LABELS)
            self._fill(family, value)
            yield family
        for name, (text, value) in COUNTERS.items():
            family = CounterMetricFamily(f"kvpager:{name}", text, labels=LABELS)
            self._fill(family, value)
            yield family
        yield self._finished()
        for name, (text, field) in HISTOGRAMS.items():
            family = HistogramMetricFamily(f"kvpager:{name}", text, labels=LABELS)
            for stats in self.stats:
                _add_histogram(family, [stats.instance], getattr(stats, field))
            yield family

    def _fill(self, family: Metric, value) -> None:
        for stats in self.stats:
            family.add_metric([stats.instance], value(stats))

    def _finished(self) -> Metric:
        text = "finished requests, by finish reason"
        family = CounterMetricFamily(
            "kvpager:request_success", text, labels=[*LABELS, "finished_reason"]
        )
        for stats in self.stats:
            for reason, count in sorted(stats.num_finished.items()):
                family.add_metric([stats.instance, reason], count)
        return family


def _add_histogram(family: HistogramMetricFamily, labels: list[str], data: Histogram) -> None:
    buckets = [(_bound(b), float(c)) for b, c in zip(data.bounds, data.counts)]
    buckets.append(("+Inf", float(data.count)))
    family.add_metric(labels, buckets, sum_value=data.sum)


def _bound(value: float) -> str:
    return repr(float(value))


def render(stats: list[Stats]) -> bytes:
    """The Prometheus text format of `stats`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return generate_latest(registry)
