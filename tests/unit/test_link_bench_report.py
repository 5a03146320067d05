"""scripts/link_bench.py's report: every cell under the target is named, and rewriting the
page's section keeps the hand-written subsections after its rendered part."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("link_bench", ROOT / "scripts/link_bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["link_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def cell(nbytes: int, ratio: float, ready_ratio: float) -> dict[str, Any]:
    head = {
        "raw_gib_s": 1.0,
        "kvpush_gib_s": ratio,
        "raw_ready_ms": 1.0,
        "kvpush_ready_ms": 1.0 / ready_ratio,
        "kvpush_ratio": ratio,
        "kvpush_ready_ratio": ready_ratio,
    }
    return {"bytes": nbytes, "headline": head}


RESULT = {
    "rates": {
        "full": {"prompt_60": cell(2 << 16, 0.71, 0.96), "large": cell(1 << 26, 0.95, 0.92)},
        "1gbit": {"prompt_60": cell(2 << 16, 0.83, 0.89), "link_tx_mib": 3.0},
    },
    "verified": True,
}


def test_every_cell_under_the_target_is_named() -> None:
    lb = load()
    text = lb.section(RESULT)
    assert "P's WRITE time: lowest 0.71 (full prompt_60); under it: full prompt_60 0.71," in text
    assert "1gbit prompt_60 0.83" in text
    assert "delivered (KV-ready): lowest 0.89 (1gbit prompt_60); under it: 1gbit" in text
    assert text.count("\n| full |") == 2 and text.count("\n| 1gbit |") == 1


def test_rewriting_the_section_keeps_its_subsections(tmp_path: Path) -> None:
    lb = load()
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# B\n\n{lb.HEADING}\n\nold table\n\n### History\n\nkept\n\n## CPU\n\nx\n")
    lb.update_doc(page, lb.section(RESULT))
    doc = page.read_text()
    assert "old table" not in doc and "| full | prompt_60 |" in doc
    assert (
        doc.index("| full | prompt_60 |") < doc.index("### History\n\nkept") < doc.index("## CPU")
    )
