"""The server's Prometheus metrics, in a registry of their own (one per app, never the process-wide
default one, so two apps in a process, e.g. in tests, count apart). Names follow vLLM's
(``vllm:num_requests_running`` -> ``neuronfx_requests_running``, ...).

The engine thread updates them; prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets (seconds): vLLM's, which span a fast decode step to a long request.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


@attrs.frozen(kw_only=True, eq=False)
class Metrics:
    """Every metric of one server, registered in ``registry``."""

    registry: CollectorRegistry
    running: Gauge  # requests holding a slot
    waiting: Gauge  # requests accepted and waiting for a slot
    slots_used: Gauge  # KV-cache slots live
    slots: Gauge  # KV-cache slots in all (the plan's batch_size)
    prompt_tokens: Counter  # prompt tokens prefilled
    generation_tokens: Counter  # tokens generated
    requests: Counter  # requests finished, by finish_reason: stop, length, abort (client gone, shutdown) or error
    rejected: Counter  # requests refused with 503 because the waiting queue was full
    ttft: Histogram  # arrival -> first token, seconds
    itl: Histogram  # between two tokens of a request, seconds
    e2e: Histogram  # arrival -> last token, seconds
    prefix_queries: Counter  # prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
    prefix_hits: Counter  # of them, tokens served from the cache (vLLM's prefix_cache_hits)
    prefix_evictions: Counter  # cached blocks evicted to make room

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def make_metrics() -> Metrics:
    """A fresh registry holding the server's metrics, all at zero."""
    r = CollectorRegistry()
    return Metrics(
        registry=r,
        running=Gauge("neuronfx_requests_running", "Requests holding a KV-cache slot (being prefilled or decoded).", registry=r),
        waiting=Gauge("neuronfx_requests_waiting", "Requests accepted and waiting for a free slot.", registry=r),
        slots_used=Gauge("neuronfx_kv_slots_used", "KV-cache slots in use.", registry=r),
        slots=Gauge("neuronfx_kv_slots", "KV-cache slots in all (the plan's batch_size).", registry=r),
        prompt_tokens=Counter("neuronfx_prompt_tokens", "Prompt tokens prefilled.", registry=r),
        generation_tokens=Counter("neuronfx_generation_tokens", "Tokens generated.", registry=r),
        requests=Counter("neuronfx_requests", "Requests finished, by finish_reason (stop, length, abort, error).",
                         ["finish_reason"], registry=r),
        rejected=Counter("neuronfx_requests_rejected", "Requests refused (503) because the waiting queue was full.", registry=r),
        ttft=Histogram("neuronfx_time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS, registry=r),
        itl=Histogram("neuronfx_inter_token_latency_seconds", "Time between two tokens of a request.", buckets=ITL_BUCKETS,
                      registry=r),
        e2e=Histogram("neuronfx_e2e_request_latency_seconds", "Arrival to last token of a request.", buckets=E2E_BUCKETS,
                      registry=r),
        prefix_queries=Counter("neuronfx_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                               "(0 without enable_prefix_caching).", registry=r),
        prefix_hits=Counter("neuronfx_prefix_cache_hits", "Prompt tokens served from the prefix cache (not prefilled).",
                            registry=r),
        prefix_evictions=Counter("neuronfx_prefix_cache_evictions", "Prefix-cache blocks evicted (least recently used) "
                                 "to make room.", registry=r),
    )
