"""Serving metrics the engine core measures: latencies, throughput, executor idle time.

Latencies come two ways: percentiles of the most recent samples (`kvpager stats`), and
cumulative histograms of every sample since start (Prometheus, through the HTTP gateway).
"""

import bisect
import time
from collections import deque
from dataclasses import dataclass

from kvpager.schemas.executor import ScheduledStep
from kvpager.schemas.public import Histogram, Percentiles

WINDOW_SAMPLES = 4096
THROUGHPUT_WINDOW_S = 10.0
# vLLM's bucket bounds (seconds), so that its dashboards read ours
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
REQUEST_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Buckets:
    """Counts of every sample (seconds) per bucket, since start."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * len(bounds)  # per bucket, not yet cumulative
        self._count = 0
        self._sum = 0.0

    def add(self, seconds: float) -> None:
        index = bisect.bisect_left(self.bounds, seconds)  # bucket i holds (b[i-1], b[i]]
        if index < len(self.bounds):
            self._counts[index] += 1
        self._count += 1
        self._sum += seconds

    def histogram(self) -> Histogram:
        cumulative, total = [], 0
        for count in self._counts:
            total += count
            cumulative.append(total)
        return Histogram(list(self.bounds), cumulative, self._count, round(self._sum, 6))


class Samples:
    """The most recent values of one latency (seconds in, milliseconds out)."""

    def __init__(self, buckets: tuple[float, ...] = ()) -> None:
        self._values: deque[float] = deque(maxlen=WINDOW_SAMPLES)
        self.buckets = Buckets(buckets)

    def add(self, seconds: float) -> None:
        self._values.append(seconds * 1000.0)
        self.buckets.add(seconds)

    def percentiles(self) -> Percentiles:
        if not self._values:
            return Percentiles()
        ordered = sorted(self._values)

        def at(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

        mean = round(sum(ordered) / len(ordered), 3)
        return Percentiles(len(ordered), mean, at(0.5), at(0.9), at(0.99))


class Throughput:
    """Generated tokens per second over the last THROUGHPUT_WINDOW_S seconds."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, num_tokens: int, now: float) -> None:
        self.total += num_tokens
        self._events.append((now, num_tokens))

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - THROUGHPUT_WINDOW_S:
            self._events.popleft()
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return round(sum(n for _, n in self._events) / min(span, THROUGHPUT_WINDOW_S), 2)


@dataclass
class _Timing:
    """One request's (all its samples') timestamps, monotonic seconds."""

    arrival: float
    scheduled_at: float | None = None  # first scheduled
    last_token_at: float | None = None


class EngineMetrics:
    def __init__(self) -> None:
        self.ttft = Samples(TTFT_BUCKETS)
        self.itl = Samples(ITL_BUCKETS)
        self.step = Samples()
        self.executor_wait = Samples()
        self.throughput = Throughput()
        self.e2e = Buckets(REQUEST_BUCKETS)
        self.queue = Buckets(REQUEST_BUCKETS)
        self.num_prompt_tokens = 0
        self._timings: dict[str, _Timing] = {}  # by request (group) id, until it ends

    def added(self, request_id: str, arrival: float) -> None:
        self._timings[request_id] = _Timing(arrival)

    def scheduled(self, step: ScheduledStep, now: float) -> None:
        """Requests scheduled for the first time: their queue time and prompt tokens."""
        for new in step.new_requests:
            timing = self._timings.get(new.seq_id)  # None for forked samples ("id#1")
            if timing is not None and timing.scheduled_at is None:
                timing.scheduled_at = now
                self.queue.add(now - timing.arrival)
                self.num_prompt_tokens += new.num_prompt_tokens

    def stepped(self, execute_s: float, wait_s: float | None, num_tokens: int, now: float) -> None:
        """One answered step: its executor time, the executor's idle time before it (when it
        was planned back to back), and the tokens it delivered."""
        self.step.add(execute_s)
        if wait_s is not None:
            self.executor_wait.add(wait_s)
        self.throughput.add(num_tokens, now)

    def token(self, request_id: str, now: float) -> None:
        """A request's new token: time to the first one, or between two."""
        timing = self._timings.get(request_id)
        if timing is None:
            return
        if timing.last_token_at is None:
            self.ttft.add(now - timing.arrival)
        else:
            self.itl.add(now - timing.last_token_at)
        timing.last_token_at = now

    def done(self, request_id: str) -> None:
        """A request whose every sample has ended, for whatever reason."""
        timing = self._timings.pop(request_id, None)
        if timing is not None:
            self.e2e.add(time.monotonic() - timing.arrival)
