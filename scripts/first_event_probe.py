"""What `return_token_ids` costs a plain vLLM server's first streamed event (CPU, tiny model).

One plain server; for each prompt size, pairs of the same greedy one-token streamed
completion with and without `return_token_ids` (which puts the prompt's ids in the first
event), in alternating order; the client's time to the first event of each. Prints one
JSON object: per size the medians, the paired differences' median and mean, and the first
event's median bytes. A CPU prefill's noise is of the order of the effect: read the paired
difference, not one sample.

    python scripts/first_event_probe.py [--rounds 16] [--sizes 256,2000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time

from kvpush.deploy.demo import default_model_dir, ensure_model
from kvpush.deploy.servers import ServerSpec, VllmServer, wait_healthy
from kvpush.tiny_model import VOCAB_SIZE


def first_event(port: int, model: str, ids: list[int], with_ids: bool) -> tuple[float, int]:
    """Seconds to the first data event of one streamed completion, and its bytes."""
    body: dict[str, object] = {"model": model, "prompt": ids, "max_tokens": 1}
    body.update(stream=True, temperature=0)
    if with_ids:
        body["return_token_ids"] = True
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    first, size = 0.0, 0
    while line := reply.readline():
        if not first and line.startswith(b"data: {"):
            first, size = time.perf_counter() - start, len(line)
    conn.close()
    if reply.status != 200 or not first:
        raise RuntimeError(f"no event (HTTP {reply.status})")
    return first, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16, help="pairs per size (the first 2 warm up)")
    p.add_argument("--sizes", default="256,2000", help="prompt sizes in tokens (model max 2048)")
    p.add_argument("--log-dir", default="/tmp/first_event_probe")
    args = p.parse_args()
    model = ensure_model(default_model_dir())  # the demo's tiny model
    spec = ServerSpec(name="plain", model=model, max_model_len=2048, log_dir=args.log_dir)
    spec.extra_args = ["--no-enable-prefix-caching"]
    server = VllmServer(spec)
    out: dict[str, object] = {}
    try:
        wait_healthy([server])
        rng = random.Random(0)
        for size in (int(s) for s in args.sizes.split(",")):
            got: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
            for i in range(args.rounds):
                ids = [rng.randrange(10, VOCAB_SIZE) for _ in range(size)]
                for with_ids in (False, True) if i % 2 else (True, False):
                    got[with_ids].append(first_event(spec.port, model, ids, with_ids))
            plain, with_ = ([t * 1e3 for t, _ in got[k][2:]] for k in (False, True))
            diff = [b - a for a, b in zip(plain, with_, strict=True)]
            med = statistics.median
            out[str(size)] = {
                "pairs": len(diff),
                "median_ms": {"without": med(plain), "with": med(with_)},
                "paired_diff_ms": {"median": med(diff), "mean": statistics.mean(diff)},
                # The median: a first token's text can hold the prompt's undecodable bytes
                # (vLLM's detokenizer), so one event's size says little.
                "first_event_bytes": {
                    "without": med(n for _, n in got[False]),
                    "with": med(n for _, n in got[True]),
                },
            }
    finally:
        server.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
