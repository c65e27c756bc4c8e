"""Prometheus metrics for ``GET /metrics``.

Counters and histograms are updated where things happen (the engine loop
observes token latencies and, as a job ends, each sequence's times and
sizes: `Metrics.observe_request`; the request path counts outcomes). The
per-sequence histograms and the finish-reason counter carry vLLM's names
(``vllm:e2e_request_latency_seconds`` is ``pagedlm_e2e_request_latency_seconds``)
and a ``model_name`` label. Gauges that
describe state (queue depth, KV bytes, paged blocks, prompt-cache and
prefix-cache counters)
are read at scrape time from the objects that own that state, so there is
no second copy to keep in step; so are speculative decoding's counters
(``pagedlm_spec_decode_num_drafts``, ``_num_draft_tokens``,
``_num_accepted_tokens``, ``_num_emitted_tokens``: vLLM's names).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pagedlm.batch.engine import CacheStats, LLMEngine
    from pagedlm.batch.sequence import Sequence

ENDPOINTS = ("completions", "chat")
OUTCOMES = ("ok", "cancelled", "invalid", "unauthorized", "rejected", "error")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1 .. 500000 tokens
FINISH_REASONS = ("stop", "length", "abort")
PROMPT_CACHE_BOUND = ("finished sequences' KV kept whole for prefix reuse, at most --prompt-cache-bytes and "
                      "within the one KV budget beside running sequences; the least recently used entry is "
                      "evicted first, when the cap or an admission needs the room")


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 401:
        return "unauthorized"
    if status == 503:
        return "rejected"
    return "invalid" if status < 500 else "error"


def _safe(read: Callable[[], float]) -> float:
    # State is read from the event loop while the engine thread changes it; a
    # value that changes mid-read counts as 0 rather than failing the scrape.
    try:
        return float(read())
    except Exception:
        return 0.0


class _StateCollector(Collector):
    """Values owned by the engine (and the engine loop's queue), read at scrape time."""

    def __init__(self, engine: "LLMEngine", queue_depth: Callable[[], int], model_name: str) -> None:
        self.engine, self.queue_depth, self.model_name = engine, queue_depth, model_name

    def collect(self) -> Iterable:
        engine = self.engine
        fraction = GaugeMetricFamily(
            "pagedlm_kv_cache_usage_perc", "KV held by running sequences as a fraction of the KV budget "
            "(0..1; vLLM's kv_cache_usage_perc); cached prefixes no sequence holds are not counted",
            labels=["model_name"])
        fraction.add_metric([self.model_name], _safe(lambda: _kv_fraction(engine)))
        yield fraction
        yield GaugeMetricFamily("pagedlm_queue_depth", "Sequences waiting to be admitted",
                                value=_safe(self.queue_depth))
        yield GaugeMetricFamily("pagedlm_running", "Sequences running in the engine",
                                value=_safe(engine.num_running))
        yield CounterMetricFamily("pagedlm_preemptions", "Sequences preempted for KV room (recomputed later)",
                                  value=engine.num_preemptions)
        usage = _safe_usage(engine)
        # One snapshot of the caches' counters per scrape: plain counts, safe to
        # read while the engine thread steps.
        caches = engine.cache_stats()
        kv = GaugeMetricFamily(
            "pagedlm_kv_bytes", "Bytes of KV cache by holder: running (held by running sequences), live_tokens "
            "(the part of it holding tokens they attend to), prompt_cache (default store: " + PROMPT_CACHE_BOUND + ")",
            labels=["holder"])
        kv.add_metric(["running"], usage[0])
        kv.add_metric(["live_tokens"], usage[1])
        kv.add_metric(["prompt_cache"], caches.prompt_cache_bytes)
        yield kv
        yield GaugeMetricFamily("pagedlm_kv_budget_bytes", "The one KV budget: the paged pool, or on the default "
                                "store the bound on running sequences' reservations plus the prompt cache",
                                value=caches.kv_budget_bytes)
        if caches.prompt_cache_entries is not None:
            yield GaugeMetricFamily("pagedlm_prompt_cache_entries", "Entries in the prompt cache (" +
                                    PROMPT_CACHE_BOUND + ")", value=caches.prompt_cache_entries)
            yield CounterMetricFamily("pagedlm_prompt_cache_hits", "Prompt-cache lookups that reused a prefix",
                                      value=caches.prompt_cache_hits)
            yield CounterMetricFamily("pagedlm_prompt_cache_misses",
                                      "Prompt-cache lookups that found nothing to reuse",
                                      value=caches.prompt_cache_misses)
        if caches.blocks_total is not None:
            yield GaugeMetricFamily("pagedlm_paged_kv_blocks_in_use", "KV blocks held by live sequences",
                                    value=caches.blocks_used)
            yield GaugeMetricFamily("pagedlm_paged_kv_blocks_free", "Free KV blocks in the shared pool",
                                    value=caches.blocks_free)
        if caches.blocks_total is not None and caches.prefix_caching:
            yield from _prefix_cache(caches)
        if engine.options.speculative is not None:
            yield from _speculative(engine)


def _speculative(engine: "LLMEngine") -> Iterable:
    """Speculative decoding's counters (vLLM's ``spec_decode`` names), and what they give."""
    spec = engine.spec_stats
    for name, value, doc in (
            ("num_drafts", spec.drafts, "Verify rows run (decode rows that proposed tokens)"),
            ("num_draft_tokens", spec.draft_tokens, "Tokens proposed"),
            ("num_accepted_tokens", spec.accepted_tokens, "Proposed tokens the model accepted"),
            ("num_emitted_tokens", spec.emitted_tokens,
             "Tokens the verify rows emitted: accepted ones plus the model's own next token")):
        yield CounterMetricFamily(f"pagedlm_spec_decode_{name}", doc, value=value)
    yield GaugeMetricFamily("pagedlm_spec_decode_acceptance_rate", "num_accepted_tokens / num_draft_tokens since start",
                            value=spec.acceptance_rate)
    yield GaugeMetricFamily("pagedlm_spec_decode_mean_accepted_length",
                            "num_emitted_tokens / num_drafts since start (vLLM's mean acceptance length)",
                            value=spec.mean_accepted_length)


def _prefix_cache(caches: "CacheStats") -> Iterable:
    """Prefix caching on the paged store: how much of the admitted tokens came
    from cached blocks, and how many blocks are cached and shared."""
    queried, hit = caches.prefix_queried_tokens, caches.prefix_hit_tokens
    yield CounterMetricFamily("pagedlm_prefix_cache_queried_tokens",
                              "Tokens of sequences admitted with prefix caching (recomputes included)", value=queried)
    yield CounterMetricFamily("pagedlm_prefix_cache_hit_tokens",
                              "Of those, tokens whose KV came from cached blocks", value=hit)
    yield GaugeMetricFamily("pagedlm_prefix_cache_hit_rate", "hit_tokens / queried_tokens since start",
                            value=hit / queried if queried else 0.0)
    yield GaugeMetricFamily("pagedlm_paged_kv_blocks_cached",
                            "KV blocks findable by prefix hash (in use or free, until evicted)",
                            value=caches.blocks_cached)
    yield GaugeMetricFamily("pagedlm_paged_kv_blocks_shared", "KV blocks held by more than one sequence",
                            value=caches.blocks_shared)


def _kv_fraction(engine: "LLMEngine") -> float:
    usage = engine.kv_usage()
    return usage.allocated / usage.capacity if usage.capacity else 0.0


def _safe_usage(engine: "LLMEngine") -> tuple[float, float]:
    try:
        usage = engine.kv_usage()
        return float(usage.allocated), float(usage.live)
    except Exception:  # the running list changed under the read
        return 0.0, 0.0


class Metrics:
    """Every metric the server exports, in its own registry (not the global one)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedlm_requests", "Generation requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        for endpoint in ENDPOINTS:  # every series exists from the start, at 0
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        self.prompt_tokens = Counter("pagedlm_prompt_tokens", "Prompt tokens processed (reused or not)",
                                     registry=r)
        self.generation_tokens = Counter("pagedlm_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("pagedlm_time_to_first_token_seconds",
                              "From request arrival (queueing included) to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pagedlm_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)

        def per_sequence(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        self.e2e = per_sequence("pagedlm_e2e_request_latency_seconds",
                                "Per sequence that got a token: request arrival to its end", REQUEST_BUCKETS)
        self.queue_time = per_sequence("pagedlm_request_queue_time_seconds",
                                       "Per sequence: request arrival to its first step", REQUEST_BUCKETS)
        self.prefill_time = per_sequence("pagedlm_request_prefill_time_seconds",
                                         "Per sequence: first step to first token (the prompt's chunks)",
                                         REQUEST_BUCKETS)
        self.decode_time = per_sequence("pagedlm_request_decode_time_seconds",
                                        "Per sequence: first token to its end", REQUEST_BUCKETS)
        self.request_prompt_tokens = per_sequence("pagedlm_request_prompt_tokens",
                                                  "Per sequence: prompt tokens (reused ones included)", TOKEN_BUCKETS)
        self.request_generation_tokens = per_sequence("pagedlm_request_generation_tokens",
                                                      "Per sequence: tokens generated", TOKEN_BUCKETS)
        self.finished = Counter("pagedlm_request_success", "Sequences ended, by finish reason (stop: end of "
                                "sequence, a stop string or token; length: max_tokens or the context; abort: "
                                "the client left or the request failed)", ["finished_reason", "model_name"],
                                registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason, model_name)

    def bind(self, engine: "LLMEngine", queue_depth: Callable[[], int]) -> None:
        """Export the state gauges of ``engine``; ``queue_depth()``: sequences
        waiting to be admitted (the engine loop's ``depth``, its inbox included)."""
        self.registry.register(_StateCollector(engine, queue_depth, self.model_name))

    def observe_request(self, created: float, seqs: list["Sequence"]) -> None:
        """Count a request that ends (finished, cancelled or failed), which
        arrived at ``created`` (``time.perf_counter``): its tokens, and per
        sequence its times, sizes and finish reason."""
        now = time.perf_counter()
        self.prompt_tokens.inc(sum(s.num_prompt for s in seqs))
        self.generation_tokens.inc(sum(len(s.output_ids) for s in seqs))
        for seq in seqs:
            reason = seq.finish_reason if seq.finish_reason in FINISH_REASONS else "abort"
            self.finished.labels(reason, self.model_name).inc()
            if seq.first_token_at is None:  # never got a token: no times to tell
                continue
            self.e2e.observe(now - created)
            self.queue_time.observe(seq.first_scheduled - created)
            self.prefill_time.observe(seq.first_token_at - seq.first_scheduled)
            self.decode_time.observe(now - seq.first_token_at)
            self.request_prompt_tokens.observe(seq.num_prompt)
            self.request_generation_tokens.observe(len(seq.output_ids))

    def record(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
