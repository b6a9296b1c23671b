"""lips/serving/metrics.py: the exposition text, parsed back with prometheus_client's own
parser; its names and buckets are vLLM's. The last test reads the kernel's figures from a
real daemon."""

from __future__ import annotations

import asyncio

from daemon import meminfo, prompt, sched
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lips.serving.metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, Metrics
from lips.serving.prefix_cache import PrefixCache
from syscalls.aio import AsyncKernel

MODEL = "test-model"
P = 16  # the test model's page size
HISTOGRAMS = {
    "symphony:time_to_first_token_seconds": TTFT_BUCKETS,
    "symphony:time_per_output_token_seconds": TPOT_BUCKETS,
    "symphony:e2e_request_latency_seconds": E2E_BUCKETS,
}


def samples(text: bytes | str) -> dict[str, float]:
    """Each sample's value by its name (a histogram's buckets as NAME_bucket{le})."""
    text = text.decode() if isinstance(text, bytes) else text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL, s
            le = s.labels.pop("le", None)
            assert not s.labels, s
            out[s.name if le is None else f"{s.name}{{{le}}}"] = s.value
    return out


def scrape(m: Metrics) -> dict[str, float]:
    return samples(generate_latest(m.registry))


def states(m: Metrics) -> tuple[float, float]:
    got = scrape(m)
    return got["symphony:num_requests_waiting"], got["symphony:num_requests_running"]


def test_the_names_are_vllms():
    got = scrape(Metrics(MODEL))
    for name in ("symphony:num_requests_running", "symphony:num_requests_waiting",
                 "symphony:kv_cache_usage_perc", "symphony:prompt_tokens_total",
                 "symphony:generation_tokens_total", "symphony:prefix_cache_queries_total",
                 "symphony:prefix_cache_hits_total"):
        assert got[name] == 0, name
    for name, buckets in HISTOGRAMS.items():
        assert got[f"{name}_count"] == 0
        assert [float(b) for b in buckets] + [float("inf")] == [
            float(key[len(name) + len("_bucket{"):-1]) for key in got
            if key.startswith(f"{name}_bucket{{")]
    assert not [name for name in got if "_total_total" in name]
    families = {f.name for f in text_string_to_metric_families(
        generate_latest(Metrics(MODEL).registry).decode())}
    assert {"symphony:prefix_cache_queries", "symphony:prefix_cache_hits",
            "symphony:prompt_tokens", "symphony:generation_tokens"} <= families


def test_a_request_moves_from_waiting_to_running_to_done():
    m = Metrics(MODEL)
    clock = m.request(prompt_tokens=12)
    assert states(m) == (1, 0)
    clock.first_token()
    assert states(m) == (0, 1)
    for choice in range(3):  # each of 3 choices' first token
        clock.tokens(1, choice)
    clock.tokens(1, 0)
    clock.tokens(1, 1)
    clock.tokens(3, 2)
    clock.finish()
    assert states(m) == (0, 0)
    clock.finish()  # every way out calls it: counted once
    got = scrape(m)
    assert states(m) == (0, 0)
    assert got["symphony:prompt_tokens_total"] == 12
    assert got["symphony:generation_tokens_total"] == 8
    assert got["symphony:time_to_first_token_seconds_count"] == 1
    # one per later call of each choice: a choice's first token is no inter-token gap
    assert got["symphony:time_per_output_token_seconds_count"] == 3
    assert got["symphony:e2e_request_latency_seconds_count"] == 1


def test_a_request_that_fails_waiting_leaves_no_count_behind():
    m = Metrics(MODEL)
    waits, runs = m.request(5), m.request(7)
    runs.tokens(1)  # tokens without first_token(): the first token all the same
    assert states(m) == (1, 1)
    waits.finish()
    runs.finish()
    got = scrape(m)
    assert states(m) == (0, 0)
    assert got["symphony:prompt_tokens_total"] == 12
    assert got["symphony:time_to_first_token_seconds_count"] == 1
    assert got["symphony:e2e_request_latency_seconds_count"] == 2
    assert got["symphony:time_per_output_token_seconds_count"] == 0


def test_the_kernel_figures_come_from_its_proc_files(daemon):
    def numeric(fields: dict[str, str]) -> set[str]:
        out = set()
        for name, text in fields.items():
            try:
                float(text)
            except ValueError:
                continue
            out.add(name)
        return out

    async def main() -> dict[str, float]:
        async with await AsyncKernel.connect(daemon.socket, name="metrics-test") as k:
            assert (await k.model_info()).page_size == P
            cache = PrefixCache(k, P, budget_pages=16)
            m = Metrics(MODEL)
            async with await k.open() as f:
                await f.pred(prompt(3 * P, salt=50), no_outputs=True)
                await cache.insert(prompt(3 * P, salt=50), f)
            hit, _ = await cache.open(prompt(3 * P, salt=50))
            await hit.close()
            text = await m.exposition(k, cache)
            await cache.close()
            return samples(text)

    with daemon.connect() as k:
        before = meminfo(k)
    got = asyncio.run(main())
    with daemon.connect() as k:
        figures = sched(k)
    used, total = int(before["device_used"]) + 3, int(before["device_total"])
    assert got["symphony:kv_cache_usage_perc"] == used / total  # the cache's 3 pages
    assert got["symphony:prefix_cache_queries_total"] == 3 * P
    assert got["symphony:prefix_cache_hits_total"] == 2 * P
    kernel = {name[len("symphony:kernel_"):] for name in got
              if name.startswith("symphony:kernel_")}
    assert kernel == numeric(figures) and "run_queue" in kernel
    assert got["symphony:kernel_token_budget"] == float(figures["token_budget"])
