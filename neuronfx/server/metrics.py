"""The server's Prometheus metrics, in a registry of their own (one per app, never the process-wide
default one, so two apps in a process, e.g. in tests, count apart). Names follow vLLM's
(``vllm:num_requests_running`` -> ``neuronfx_requests_running``, ...), and the ones routers and
dashboards read are also served under vLLM's own names with a ``model_name`` label
(:data:`VLLM_ALIASES`): the gateway API inference extension's model-server protocol reads the
queue (``vllm:num_requests_waiting``) and the KV cache use (``vllm:kv_cache_usage_perc``, formerly
``vllm:gpu_cache_usage_perc``) to pick a replica.

The engine thread updates them; prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest

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
    kv_usage: Gauge  # fraction of the KV cache in use: slots in use / slots (blocks layout: blocks held / blocks)
    kv_blocks_used: Gauge  # KV blocks held by requests (blocks layout; 0 for slots)
    kv_blocks: Gauge  # KV blocks in all, the scratch block excluded (blocks layout; 0 for slots)
    preemptions: Counter  # requests preempted (their blocks taken back, recomputed later)
    prefix_hit_rate: Gauge  # prefix_hits / prefix_queries since the start
    waiting_limit: Gauge  # the most requests that may wait (--max-waiting)
    max_model_len: Gauge  # tokens a request may hold, prompt and generated (the plan's sequence_length)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "neuronfx_requests_running": ("vllm:num_requests_running",),
    "neuronfx_requests_waiting": ("vllm:num_requests_waiting",),
    "neuronfx_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "neuronfx_prompt_tokens": ("vllm:prompt_tokens",),
    "neuronfx_generation_tokens": ("vllm:generation_tokens",),
    "neuronfx_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "neuronfx_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "neuronfx_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "neuronfx_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "neuronfx_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "neuronfx_num_preemptions": ("vllm:num_preemptions",),
}
"""neuronfx metric family -> the vLLM names it is also served under (vLLM 0.11's
``vllm/v1/metrics/loggers.py``; ``vllm:gpu_cache_usage_perc`` is the name before 0.10, which the
gateway API inference extension's reference endpoint picker still reads)."""


@attrs.frozen
class VllmAliases:
    """A prometheus-client collector serving each of ``sources``' families named in
    :data:`VLLM_ALIASES` again under its vLLM names, samples renamed and labelled ``model_name``
    (vLLM labels every metric so): the same values at every scrape, counted once."""

    sources: tuple[Gauge | Counter | Histogram, ...]
    model_name: str

    def collect(self) -> list[Metric]:
        out = []
        for family in (f for source in self.sources for f in source.collect()):
            for alias in VLLM_ALIASES.get(family.name, ()):
                renamed = Metric(alias, family.documentation, family.type)
                renamed.samples = [s._replace(name=alias + s.name[len(family.name):], labels={**s.labels, "model_name": self.model_name})
                                   for s in family.samples]
                out.append(renamed)
        return out


def make_metrics(model_name: str = "") -> Metrics:
    """A fresh registry holding the server's metrics, all at zero, and their vLLM aliases
    labelled ``model_name`` (the served model's name)."""
    r = CollectorRegistry()
    metrics = _metrics(r)
    r.register(VllmAliases(sources=tuple(getattr(metrics, f.name) for f in attrs.fields(Metrics) if f.name != "registry"),
                           model_name=model_name))
    return metrics


def _metrics(r: CollectorRegistry) -> Metrics:
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
        kv_usage=Gauge("neuronfx_kv_cache_usage_perc", "Fraction of the KV cache in use, 0 to 1: slots in use / slots (a slot "
                       "holds sequence_length positions whatever its request uses), or with --kv-layout blocks KV blocks "
                       "held / KV blocks.", registry=r),
        kv_blocks_used=Gauge("neuronfx_kv_blocks_used", "KV blocks held by requests (--kv-layout blocks; 0 with slots).",
                             registry=r),
        kv_blocks=Gauge("neuronfx_kv_blocks", "KV blocks in all (--kv-layout blocks; 0 with slots).", registry=r),
        preemptions=Counter("neuronfx_num_preemptions", "Requests preempted: their KV blocks taken back for older requests, "
                            "their caches recomputed when blocks are free (--kv-layout blocks).", registry=r),
        prefix_hit_rate=Gauge("neuronfx_prefix_cache_hit_rate", "Prefix-cache hits / queries (prompt tokens) since the start; "
                              "0 before any query.", registry=r),
        waiting_limit=Gauge("neuronfx_requests_waiting_limit", "The most requests that may wait for a slot (--max-waiting); "
                            "one more is refused with 503.", registry=r),
        max_model_len=Gauge("neuronfx_max_model_len", "Tokens a request may hold, prompt and generated (the plan's "
                            "sequence_length).", registry=r),
    )
