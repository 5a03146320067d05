"""kvpush_bench.server_metrics: vLLM's request histograms read from the Prometheus text
format, and their means between two scrapes. That vLLM serves these families is checked
against live servers in tests/e2e/test_drop_in.py."""

from __future__ import annotations

from kvpush_bench import server_metrics as sm

TTFT = "vllm:time_to_first_token_seconds"
QUEUE = "vllm:request_queue_time_seconds"


def _text(ttft_sum: float, ttft_n: int, queue_sum: float, queue_n: int) -> str:
    return "\n".join(
        [
            f"# HELP {TTFT} Histogram of time to first token in seconds.",
            f"# TYPE {TTFT} histogram",
            f'{TTFT}_bucket{{engine="0",le="0.1",model_name="m"}} {ttft_n}',
            # two label sets (two engines): summed
            f'{TTFT}_sum{{engine="0",model_name="m"}} {ttft_sum / 2}',
            f'{TTFT}_sum{{engine="1",model_name="m"}} {ttft_sum / 2}',
            f'{TTFT}_count{{engine="0",model_name="m"}} {ttft_n}',
            f'{TTFT}_created{{engine="0",model_name="m"}} 1.7e9',
            f'{QUEUE}_sum{{engine="0",model_name="m"}} {queue_sum}',
            f'{QUEUE}_count{{engine="0",model_name="m"}} {queue_n}',
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            "not a sample line",
            "",
        ]
    )


def test_parse_keeps_only_the_families_sums_and_counts() -> None:
    got = sm.parse(_text(0.5, 10, 0.2, 10))
    assert got == {f"{TTFT}_sum": 0.5, f"{TTFT}_count": 10.0, f"{QUEUE}_sum": 0.2,
                   f"{QUEUE}_count": 10.0}  # fmt: skip


def test_means_between_two_scrapes() -> None:
    before = sm.parse(_text(0.5, 10, 0.2, 10))
    after = sm.parse(_text(1.7, 30, 0.6, 30))
    got = sm.means(before, after)
    assert got["n"] == 20
    assert got["ttft_ms"] == 60.0 and got["queue_ms"] == 20.0
    assert got["prefill_ms"] is None and got["decode_ms"] is None  # not served


def test_no_request_between_scrapes_or_nothing_served_gives_no_mean() -> None:
    same = sm.parse(_text(0.5, 10, 0.2, 10))
    assert sm.means(same, same) == {"n": 0, "ttft_ms": None, "queue_ms": None,
                                    "prefill_ms": None, "decode_ms": None}  # fmt: skip
    assert sm.means({}, {})["n"] is None
