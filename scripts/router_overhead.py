"""Time GET /v1/models (no model work: the HTTP path alone) against each server URL given, and
print each one's median and p90 latency and the difference to the first: the cost of the hops a
request takes (for ``neuronfx serve --data-parallel-size``: Ray Serve's proxy, the ingress, the
request router and the replica's in-process ASGI call) beside a single ``neuronfx serve``.

    python scripts/router_overhead.py http://127.0.0.1:8000 http://127.0.0.1:8001 --requests 300
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import time
import urllib.parse


def latencies(url: str, requests: int) -> list[float]:
    """Seconds of ``requests`` sequential GET /v1/models on one kept-alive connection (after 20 to warm up)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    out = []
    for k in range(requests + 20):
        t0 = time.perf_counter()
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise SystemExit(f"{url}/v1/models answered {resp.status}")
        if k >= 20:
            out.append(time.perf_counter() - t0)
    conn.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("urls", nargs="+", help="servers; the first is the baseline")
    p.add_argument("--requests", type=int, default=300)
    args = p.parse_args()
    rows = []
    for url in args.urls:
        lat = sorted(latencies(url, args.requests))
        rows.append((url, statistics.median(lat) * 1e3, lat[int(0.9 * len(lat))] * 1e3))
    print("| server | p50 ms | p90 ms | p50 - baseline ms |\n| --- | --- | --- | --- |")
    for url, p50, p90 in rows:
        print(f"| {url} | {p50:.2f} | {p90:.2f} | {p50 - rows[0][1]:+.2f} |")


if __name__ == "__main__":
    main()
