"""Several processes play P ranks and D ranks of different TP and PP; every D rank checks
every byte of every layer it holds."""

from __future__ import annotations

import pytest

from kvpush_bench.sim.demo import DemoOptions, run_demo

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "p_tp, d_tp, p_pp, mla, packed",
    [
        (1, 2, 1, False, False),  # one P rank feeds two D ranks their head halves
        (2, 1, 1, False, False),  # two P ranks fill one D rank
        (2, 4, 1, False, False),
        (1, 2, 1, True, False),  # MLA: the page is written to both D ranks
        (2, 1, 2, False, False),  # two PP stages, each writes only its layers
        (2, 1, 2, True, True),  # packed MLA rows: each stage writes its slots of D's rows
    ],
    ids=["tp1-tp2", "tp2-tp1", "tp2-tp4", "mla-tp1-tp2", "pp2-tp2-tp1", "packed-pp2"],
)
def test_ranks_push_every_byte(p_tp: int, d_tp: int, p_pp: int, mla: bool, packed: bool) -> None:
    s = run_demo(
        DemoOptions(
            requests=6,
            max_blocks=6,
            layers=4,
            block_bytes=4096,
            num_blocks=256,
            window=6,
            seed=3,
            timeout_s=120,
            p_tp=p_tp,
            d_tp=d_tp,
            p_pp=p_pp,
            mla=mla,
            packed=packed,
        )
    )
    assert s["completed"] == 6 and s["failed"] == 0 and s["corrupted"] == 0, s
    assert s["held_blocks_p"] == 0 and s["held_blocks_d"] == 0, s
    assert s["p_ranks"] == p_tp * p_pp and s["d_ranks"] == d_tp
    assert s["bytes_verified"] > 0
