"""Where a served request's time to first token goes, from kvpager's own /metrics.

The scheduler stamps each request's arrival, its first step and its first token (the
`kvpager:request_queue_time_seconds` and `kvpager:time_to_first_token_seconds` histograms), so
the deltas of their sums and counts over one client run split the client's mean TTFT into:
  hops     the client's TTFT less the scheduler's: HTTP, chat template and tokenizer, the NATS
           hops to the scheduler, and the first token's way back (detokenizer, gateway, SSE)
  queue    arrival at the scheduler to the request's first step
  prefill  first step to first token: the prefill steps (and any decode steps they share)
and `engine_steps` over the run's requests counts steps per request (every step: with 4 tokens
out and one request at a time, the prefill's steps and 3 or 4 decode steps).
"""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "queue": "request_queue_time_seconds"}


def scrape(port: int) -> dict[str, float]:
    """Every sample of kvpager's /metrics page by name (no `kvpager:`), summed over labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("kvpager:")
            values[name] = values.get(name, 0.0) + sample.value
    return values


def split(before: dict[str, float], after: dict[str, float], client_ttft_ms: float) -> dict:
    """Mean milliseconds per part over the run between two scrapes (see the module's doc)."""

    def mean_ms(name: str) -> float:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        return 1e3 * total / count if count else float("nan")

    ttft, queue = (mean_ms(HISTOGRAMS[part]) for part in ("ttft", "queue"))
    requests = after.get(f"{HISTOGRAMS['ttft']}_count", 0) - before.get(
        f"{HISTOGRAMS['ttft']}_count", 0
    )
    steps = after.get("engine_steps_total", 0.0) - before.get("engine_steps_total", 0.0)
    return {
        "client_ttft_mean_ms": client_ttft_ms,
        "hops_ms": client_ttft_ms - ttft,
        "queue_ms": queue,
        "prefill_ms": ttft - queue,
        "steps_per_request": steps / requests if requests else float("nan"),
    }


def describe(parts: dict) -> str:
    return (
        f"TTFT mean {parts['client_ttft_mean_ms']:.1f} ms = hops {parts['hops_ms']:.1f} + queue "
        f"{parts['queue_ms']:.1f} + prefill {parts['prefill_ms']:.1f} "
        f"({parts['steps_per_request']:.2f} steps a request, decodes too)"
    )
