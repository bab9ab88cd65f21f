"""Serving metrics the scheduler measures: latencies, throughput, executor idle time."""

import time
from collections import deque

from schemas.public import Percentiles
from services.scheduler.outbox import Route

WINDOW_SAMPLES = 4096
THROUGHPUT_WINDOW_S = 10.0


class Samples:
    """The most recent values of one latency (seconds in, milliseconds out)."""

    def __init__(self) -> None:
        self._values: deque[float] = deque(maxlen=WINDOW_SAMPLES)

    def add(self, seconds: float) -> None:
        self._values.append(seconds * 1000.0)

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


class ServiceMetrics:
    def __init__(self) -> None:
        self.ttft = Samples()
        self.itl = Samples()
        self.step = Samples()
        self.executor_wait = Samples()
        self.throughput = Throughput()

    def time_token(self, route: Route, now: float) -> None:
        """A request's new token: time to the first one, or between two."""
        if route.first_token_at is None:
            route.first_token_at = now
            self.ttft.add(now - route.arrival)
        else:
            self.itl.add(now - route.last_token_at)
        route.last_token_at = now
