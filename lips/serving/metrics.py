"""The server's Prometheus metrics, named as vLLM's (`vllm:` becomes `symphony:`), so its
dashboards carry over: the same names, label (`model_name`), units and histogram buckets.

Counters are exposed as prometheus_client (and vLLM) do: the family
`symphony:prompt_tokens` has the sample `symphony:prompt_tokens_total`, and
`symphony:prefix_cache_queries` the sample `symphony:prefix_cache_queries_total`.
Figures kept elsewhere (the kernel's /proc/meminfo and /proc/sched, the prefix cache's
counters) are read when scraped and exposed by a collector of their own.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from lips.serving.prefix_cache import PrefixCache
from syscalls.aio import AsyncKernel
from syscalls.convert import proc_fields

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class _Scraped:
    """The figures read at scrape time, as metric families (a custom collector)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.meminfo: dict[str, str] = {}
        self.sched: dict[str, str] = {}
        self.queries = self.hits = 0

    def collect(self) -> Iterator[Metric]:
        labels, values = ["model_name"], [self.model_name]
        usage = GaugeMetricFamily(
            "symphony:kv_cache_usage_perc",
            "KV-cache usage: the kernel's device pages in use (1 means 100 percent).",
            labels=labels)
        total = int(self.meminfo.get("device_total", 0))
        usage.add_metric(values, int(self.meminfo.get("device_used", 0)) / total if total else 0)
        yield usage
        for name, count, doc in (
            ("queries", self.queries, "Prefix cache queries, in terms of number of queried "
                                      "tokens."),
            ("hits", self.hits, "Prefix cache hits, in terms of number of cached tokens."),
        ):
            family = CounterMetricFamily(f"symphony:prefix_cache_{name}", doc, labels=labels)
            family.add_metric(values, count)
            yield family
        for field, text in self.sched.items():
            value = _number(text)
            if value is None or not _NAME.fullmatch(field):
                continue
            family = GaugeMetricFamily(f"symphony:kernel_{field}",
                                       f"The kernel's /proc/sched {field}.", labels=labels)
            family.add_metric(values, value)
            yield family


class RequestClock:
    """One request's timeline: waiting until its first token, then running, then done."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._start = time.perf_counter()
        self._last: dict[int, float] = {}  # per choice: when its previous tokens() came
        self._state = "waiting"
        metrics.waiting.inc()

    def first_token(self) -> None:
        """The first token is out: waiting -> running, observes the time to it."""
        if self._state != "waiting":
            return
        m = self._metrics
        m.waiting.dec()
        m.running.inc()
        m.ttft.observe(time.perf_counter() - self._start)
        self._state = "running"

    def tokens(self, n: int, choice: int = 0) -> None:
        """n more generated tokens of one choice (of an n > 1 request), the first ones
        included (the first call is the first token, if first_token() was not called). Each
        call after a choice's first observes the time since that choice's previous one as
        a time per output token (vLLM's inter-token latency): choices decoding side by side
        do not shorten each other's."""
        if self._state == "waiting":
            self.first_token()
        self._metrics.generation_tokens.inc(n)
        now = time.perf_counter()
        last = self._last.get(choice)
        if last is not None:
            self._metrics.tpot.observe(now - last)
        self._last[choice] = now

    def finish(self) -> None:
        """running (or waiting) -> done, observes the request's latency; idempotent."""
        if self._state == "done":
            return
        m = self._metrics
        (m.waiting if self._state == "waiting" else m.running).dec()
        m.e2e.observe(time.perf_counter() - self._start)
        self._state = "done"


class Metrics:
    """prometheus_client metrics named as vLLM's, in a registry of the server's own."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels, r = ["model_name"], self.registry
        self.running = Gauge("symphony:num_requests_running",
                             "Number of requests in model execution batches.", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge("symphony:num_requests_waiting",
                             "Number of requests waiting to be processed.", labels,
                             registry=r).labels(model_name)
        self.prompt_tokens = Counter("symphony:prompt_tokens",
                                     "Number of prefill tokens processed.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("symphony:generation_tokens",
                                         "Number of generation tokens processed.", labels,
                                         registry=r).labels(model_name)
        self.preemptions = Counter("symphony:num_preemptions",
                                   "Cumulative number of preemption from the engine.", labels,
                                   registry=r).labels(model_name)
        self.ttft = Histogram("symphony:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              registry=r, buckets=TTFT_BUCKETS).labels(model_name)
        self.tpot = Histogram("symphony:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", labels,
                              registry=r, buckets=TPOT_BUCKETS).labels(model_name)
        self.e2e = Histogram("symphony:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", labels,
                             registry=r, buckets=E2E_BUCKETS).labels(model_name)
        self._scraped = _Scraped(model_name)
        r.register(self._scraped)

    def request(self, prompt_tokens: int) -> RequestClock:
        """A request arrived: counted waiting until its first token."""
        self.prompt_tokens.inc(prompt_tokens)
        return RequestClock(self)

    async def exposition(self, kernel: AsyncKernel, cache: PrefixCache) -> bytes:
        """The metrics in Prometheus' text format, the kernel's figures read now."""
        meminfo = proc_fields(await kernel.procfs("meminfo"))
        sched = proc_fields(await kernel.procfs("sched"))
        s = self._scraped  # set and rendered with no await between: one scrape's figures
        s.meminfo, s.sched, s.queries, s.hits = meminfo, sched, cache.queries, cache.hits
        return generate_latest(self.registry)
