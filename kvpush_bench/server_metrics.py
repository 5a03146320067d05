"""vLLM's own per-request timings, read from a server's ``/metrics`` around a benchmark run.

A client's TTFT is the sum of what each hop adds; these say which hop. vLLM keeps, per
request, the time it waited in the scheduler's queue (``queue``: queued to first scheduled;
on a decoder that loads KV, the wait for the KV too), from then to its first token
(``prefill``), and from its arrival at the server to its first token (``ttft``). Each is a
histogram whose ``_sum`` and ``_count`` grow with every finished request, so the difference
of two scrapes gives the mean over the requests that ended between them.
"""

from __future__ import annotations

from typing import Any

from kvpush.deploy.servers import metric_in, metrics_text

FAMILIES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
}


def parse(text: str) -> dict[str, float]:
    """``{family}_sum`` and ``{family}_count`` of each of FAMILIES, summed over label sets
    (one per engine and model name); a family absent from ``text`` is absent here."""
    out: dict[str, float] = {}
    for family in FAMILIES.values():
        for name in (f"{family}_sum", f"{family}_count"):
            value = metric_in(text, name)
            if value is not None:
                out[name] = value
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """parse() of ``url``/metrics."""
    return parse(metrics_text(url.rstrip("/"), timeout))


def means(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Requests finished between two scrapes (``n``) and each family's mean over them in ms
    (``<key>_ms``); None where no request finished or a family was not served."""
    out: dict[str, Any] = {}
    for key, name in FAMILIES.items():
        s0, s1 = before.get(f"{name}_sum"), after.get(f"{name}_sum")
        c0, c1 = before.get(f"{name}_count"), after.get(f"{name}_count")
        n = None if c0 is None or c1 is None else c1 - c0
        if key == "ttft":
            out["n"] = None if n is None else int(n)
        mean = None
        if n and s0 is not None and s1 is not None:
            mean = round((s1 - s0) / n * 1000, 2)
        out[f"{key}_ms"] = mean
    return out
