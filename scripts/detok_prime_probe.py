"""What a request's first output costs vLLM's detokenizer, by prompt length (CPU, no server).

vLLM 0.32's `FastIncrementalDetokenizer` builds a `tokenizers` `DecodeStream` primed with
the request's whole prompt (`ids=prompt_token_ids`); the stream decodes that prefix at its
first `step`, that is when the request's first output token reaches the API server's
output handler. This times that first step, and the second, with the demo model's
tokenizer and random prompts. Prints one JSON object: per prompt length the medians in ms.

    python scripts/detok_prime_probe.py [--sizes 256,2048,8000,32000] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvpush.deploy.demo import default_model_dir, ensure_model
from kvpush.tiny_model import VOCAB_SIZE


def steps(tok: Tokenizer, prompt: list[int]) -> tuple[float, float]:
    """ms of the first and the second `step` of a stream primed with ``prompt``."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    t0 = time.perf_counter()
    stream.step(tok, 42)
    t1 = time.perf_counter()
    stream.step(tok, 43)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="256,2048,8000,32000")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    model = ensure_model(default_model_dir())
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    rng = random.Random(0)
    out: dict[str, dict[str, float]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(size)] for _ in range(args.rounds)]
        got = [steps(tok, prompt) for prompt in prompts]
        out[str(size)] = {
            "first_step_ms": round(statistics.median(g[0] for g in got), 3),
            "second_step_ms": round(statistics.median(g[1] for g in got), 3),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
