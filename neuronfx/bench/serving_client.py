"""``neuronfx bench serving``'s client: load an OpenAI-compatible server (``neuronfx serve``,
llama.cpp's, vLLM's, ...) over HTTP with the official ``openai`` client and measure what its
users see.

Workload: ``num_requests`` streamed ``/v1/completions`` requests, ``concurrency`` in flight at a
time (a new one starts as one ends; all are queued at once, vLLM's ``--max-concurrency`` with an
infinite request rate). Request i has a prompt of a length drawn uniformly from
``prompt_range`` tokens, a window of real English text (``neuronfx/data/bench_text.txt``:
public-domain passages, by default) at a random offset, and generates a length drawn uniformly
from ``gen_range``; the draws come from ``random.Random(seed)``, so the same seed gives every
server the same requests. Generation is greedy and asks for the full length: ``max_tokens`` and
``min_tokens`` = the length and vLLM's ``ignore_eos: true`` (neuronfx and vLLM honour both;
llama-cpp-python's server honours ``min_tokens`` by masking the model's eos id and ignores the
unknown ``ignore_eos``, so it can still stop early at another end-of-generation token: such
requests are counted as ``short``).

Metrics follow vLLM's ``benchmarks/benchmark_serving.py``, from the client's clock
(``time.perf_counter``) at each streamed chunk's arrival: TTFT = first chunk carrying text -
request sent; ITL = the gaps between consecutive text chunks (a chunk of several tokens is one
gap); TPOT = (latency - TTFT) / (output tokens - 1) per request; output tok/s = all output
tokens / the run's wall time (first request sent to last one done). Output tokens are the
server's ``usage.completion_tokens`` when it reports them (``stream_options.include_usage``),
else the number of text chunks (llama.cpp's server sends one token per chunk). Times are
seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import attrs

from neuronfx.bench.timing import percentile
from neuronfx.bench.workload import make_workload, token_ids
from neuronfx.errors import BackendUnavailableError, InputError

PERCENTILES = (50, 90, 99)


@attrs.frozen(kw_only=True)
class ServingRequest:
    """One request of the workload."""

    prompt: str
    prompt_len: int  # tokens of ``prompt`` by the workload's tokenizer
    max_tokens: int  # tokens asked for (max_tokens = min_tokens)


@attrs.frozen(kw_only=True)
class RequestTiming:
    """What one request did, stamped with the client's ``time.perf_counter`` (seconds)."""

    prompt_len: int
    max_tokens: int
    sent: float  # when the request was sent
    chunks: tuple[float, ...]  # arrival of each streamed chunk that carried text
    done: float  # when the stream ended (or failed)
    output_tokens: int  # usage.completion_tokens, else len(chunks)
    usage_reported: bool  # whether output_tokens came from the server's usage
    text: str = ""  # the streamed text
    error: str | None = None  # None when it completed


@attrs.frozen(kw_only=True)
class ServingResult:
    """One server's row: counts, throughput and latency percentiles (seconds)."""

    server: str  # label
    url: str
    model: str
    num_requests: int
    concurrency: int
    completed: int
    failed: int
    short: int  # completed requests with fewer output tokens than asked
    duration_s: float  # wall time of the run
    prompt_tokens: int
    output_tokens: int
    request_per_s: float
    output_tok_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_mean_s: float
    itl_p50_s: float
    itl_p90_s: float
    itl_p99_s: float
    tpot_mean_s: float
    errors: tuple[str, ...] = ()  # the first few distinct error messages


# --- statistics -----------------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; nan for no values."""
    return sum(values) / len(values) if values else float("nan")


def ttft(t: RequestTiming) -> float:
    """Seconds from sending the request to its first text chunk (nan without one)."""
    return t.chunks[0] - t.sent if t.chunks else float("nan")


def inter_token_latencies(t: RequestTiming) -> list[float]:
    """The gaps between consecutive text chunks, seconds ([len(chunks) - 1])."""
    return [b - a for a, b in zip(t.chunks, t.chunks[1:])]


def tpot(t: RequestTiming) -> float | None:
    """(latency - TTFT) / (output tokens - 1), seconds; None for a request of < 2 tokens."""
    if t.output_tokens < 2 or not t.chunks:
        return None
    return (t.done - t.chunks[0]) / (t.output_tokens - 1)


def summarize(server: str, url: str, model: str, timings: Sequence[RequestTiming], concurrency: int, duration_s: float) -> ServingResult:
    """One row from the run's request timings and its wall time (seconds); percentiles over the
    completed requests (TTFT: one per request; ITL: every gap of every request)."""
    ok = [t for t in timings if t.error is None]
    ttfts = [ttft(t) for t in ok if t.chunks]
    itls = [gap for t in ok for gap in inter_token_latencies(t)]
    tpots = [x for x in (tpot(t) for t in ok) if x is not None]
    out_tokens = sum(t.output_tokens for t in ok)
    q = {p: (percentile(ttfts, p), percentile(itls, p)) for p in PERCENTILES}
    errors = tuple(dict.fromkeys(t.error for t in timings if t.error is not None))[:3]
    return ServingResult(
        server=server, url=url, model=model, num_requests=len(timings), concurrency=concurrency, completed=len(ok),
        failed=len(timings) - len(ok), short=sum(t.output_tokens < t.max_tokens for t in ok), duration_s=duration_s,
        prompt_tokens=sum(t.prompt_len for t in ok), output_tokens=out_tokens,
        request_per_s=len(ok) / duration_s, output_tok_s=out_tokens / duration_s,
        ttft_mean_s=mean(ttfts), ttft_p50_s=q[50][0], ttft_p90_s=q[90][0], ttft_p99_s=q[99][0],
        itl_mean_s=mean(itls), itl_p50_s=q[50][1], itl_p90_s=q[90][1], itl_p99_s=q[99][1],
        tpot_mean_s=mean(tpots), errors=errors,
    )


def format_table(results: Sequence[ServingResult]) -> list[str]:
    """The results as a Markdown table, one row per server (times in ms)."""
    head = ("| server | requests ok | out tokens | wall s | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
            "| TPOT mean ms |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        ok = f"{r.completed}/{r.num_requests}" + (f" ({r.short} short)" if r.short else "")
        lines.append(f"| {r.server} | {ok} | {r.output_tokens} | {r.duration_s:.1f} | {r.output_tok_s:.1f} | "
                     f"{_ms(r.ttft_p50_s)} / {_ms(r.ttft_p90_s)} / {_ms(r.ttft_p99_s)} | "
                     f"{_ms(r.itl_p50_s)} / {_ms(r.itl_p90_s)} / {_ms(r.itl_p99_s)} | {_ms(r.tpot_mean_s)} |")
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds == seconds else "-"  # nan: no value


# --- the workload as text ------------------------------------------------------------------------


def text_workload(tokenizer: Any, text: str, num_requests: int, prompt_range: tuple[int, int], gen_range: tuple[int, int],
                  seed: int = 0) -> list[ServingRequest]:
    """:func:`~neuronfx.bench.workload.make_workload` over ``text``'s tokens, each window decoded
    to text. ``prompt_len`` is the window's text encoded again (it can differ from the drawn
    length by a token where the window cuts a word; it never exceeds ``prompt_range[1]``).
    Raises InputError for a text of no tokens or a bad range."""
    work = make_workload(token_ids(tokenizer, text), num_requests, prompt_range, gen_range, seed)
    requests = []
    for r in work:
        prompt, n_tokens = _window(tokenizer, list(r.prompt_ids), prompt_range[1])
        requests.append(ServingRequest(prompt=prompt, prompt_len=n_tokens, max_tokens=r.max_tokens))
    return requests


def _window(tokenizer: Any, ids: list[int], limit: int) -> tuple[str, int]:
    """(text of ``ids``, its token count when encoded again), shortened until the count is at
    most ``limit``."""
    while True:
        prompt = tokenizer.decode(ids)
        n = len(tokenizer.encode(prompt, add_special_tokens=False))
        if n <= limit or len(ids) == 1:
            return prompt, n
        ids = ids[:-1]


# --- the client ---------------------------------------------------------------------------------


def import_openai() -> Any:
    """The ``openai`` module; BackendUnavailableError naming the install when it is missing."""
    try:
        import openai
    except ImportError as exc:
        raise BackendUnavailableError("bench serving drives servers with the official openai client, which is not installed: "
                                      "pip install 'neuronfx[bench]' (or pip install openai).") from exc
    return openai


def base_url(url: str) -> str:
    """The openai client's base URL of a server URL: ``http://host:port`` gets ``/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def parse_server(spec: str) -> tuple[str, str]:
    """(label, url) of ``--server [LABEL=]URL``; the label defaults to the URL. InputError for
    a URL that is not http(s)."""
    label, sep, url = spec.partition("=")
    if not sep or "://" in label:
        label, url = spec, spec
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--server {spec!r}: the URL must start with http:// or https://, e.g. http://127.0.0.1:8000.")
    return label, url


async def _one_request(client: Any, model: str, req: ServingRequest, ignore_eos: bool) -> RequestTiming:
    """Send one streamed completion and stamp its chunks."""
    openai = import_openai()

    extra = {"min_tokens": req.max_tokens, "ignore_eos": True} if ignore_eos else {}
    chunks: list[float] = []
    text, usage = [], None
    sent = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                chunks.append(now)
                text.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        error = None
    except openai.APIError as exc:  # HTTP errors, broken streams, timeouts: the request failed, the run goes on
        error = f"{type(exc).__name__}: {exc}"
    return RequestTiming(prompt_len=req.prompt_len, max_tokens=req.max_tokens, sent=sent, chunks=tuple(chunks),
                         done=time.perf_counter(), output_tokens=len(chunks) if usage is None else usage,
                         usage_reported=usage is not None, text="".join(text), error=error)


async def _run(url: str, model: str | None, workload: Sequence[ServingRequest], concurrency: int, ignore_eos: bool,
               timeout_s: float, warmup: bool) -> tuple[str, list[RequestTiming], float]:
    openai = import_openai()

    async with openai.AsyncOpenAI(base_url=base_url(url), api_key="unused", max_retries=0, timeout=timeout_s) as client:
        if model is None:
            try:
                models = await client.models.list()
            except openai.APIConnectionError as exc:
                raise InputError(f"cannot reach the server at {url} ({exc}); start it, or fix --server.") from exc
            if not models.data:
                raise InputError(f"{url} lists no model at /v1/models; give --model-name NAME.")
            model = models.data[0].id
        if warmup:  # the server's first request may pay one-off costs (allocation, lazy init)
            await _one_request(client, model, ServingRequest(prompt=workload[0].prompt, prompt_len=workload[0].prompt_len,
                                                             max_tokens=2), ignore_eos)
        gate = asyncio.Semaphore(concurrency)

        async def limited(req: ServingRequest) -> RequestTiming:
            async with gate:
                return await _one_request(client, model, req, ignore_eos)

        t0 = time.perf_counter()
        timings = await asyncio.gather(*(limited(r) for r in workload))
        return model, list(timings), time.perf_counter() - t0


def bench_server(url: str, workload: Sequence[ServingRequest], concurrency: int, label: str | None = None,
                 model: str | None = None, ignore_eos: bool = True, timeout_s: float = 600.0,
                 warmup: bool = True) -> tuple[ServingResult, list[RequestTiming]]:
    """Run ``workload`` against the server at ``url`` with ``concurrency`` requests in flight;
    ``model`` defaults to the first id of its ``/v1/models``. Returns its row and the request
    timings (input order). A request that fails is counted, not raised. Raises InputError for
    a server that cannot be reached (when listing its models) or lists no model."""
    if concurrency < 1 or not workload:
        raise InputError(f"concurrency={concurrency} must be >= 1 and the workload must hold requests ({len(workload)}).")
    model, timings, duration = asyncio.run(_run(url, model, workload, concurrency, ignore_eos, timeout_s, warmup))
    return summarize(label or url, url, model, timings, concurrency, duration), timings


def run_benchmark(servers: Sequence[str], workload: Sequence[ServingRequest], concurrency: int, model: str | None = None,
                  ignore_eos: bool = True, timeout_s: float = 600.0, log: Any = print) -> list[ServingResult]:
    """:func:`bench_server` for each ``[LABEL=]URL`` in turn, same workload; one row each."""
    parsed = [parse_server(s) for s in servers]
    results = []
    for label, url in parsed:
        log(f"{label}: {len(workload)} requests, {concurrency} concurrent ...")
        result, _ = bench_server(url, workload, concurrency, label=label, model=model, ignore_eos=ignore_eos, timeout_s=timeout_s)
        log(f"{label}: {result.output_tokens} tokens in {result.duration_s:.1f} s = {result.output_tok_s:.1f} tok/s")
        results.append(result)
    return results
