"""Stage timestamps of each transfer, for finding where a request's time goes.

Off unless ``KVPUSH_TRACE_DIR`` names a directory when the process starts: then every
``mark`` appends one JSON line ``{"t": wall-clock seconds, "ev": stage, "id": key,
"rid": request id}`` to ``<dir>/<pid>.jsonl``. The wall clock is the one clock every
process on a host shares (P, D, the router and the client). When off, ``mark`` is one
global read.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO

DIR = os.environ.get("KVPUSH_TRACE_DIR", "")
ON = bool(DIR)
_lock = threading.Lock()
_out: IO[str] | None = None


def mark(event: str, key: str | None, rid: str | None = None, n: int | None = None) -> None:
    """Record that ``event`` happened now for transfer ``key`` (a transfer id or request id);
    ``n``: a count that goes with it (a step's scheduled tokens, say)."""
    if not ON:
        return
    rec: dict[str, object] = {"t": time.time(), "ev": event, "id": key, "rid": rid}
    if n is not None:
        rec["n"] = n
    line = json.dumps(rec)
    global _out
    with _lock:  # the engine thread, the keeper and handshake callbacks may all mark
        if _out is None:
            os.makedirs(DIR, exist_ok=True)
            _out = open(os.path.join(DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)
        _out.write(line + "\n")


def read(directory: str) -> list[dict[str, object]]:
    """Every mark written under ``directory``, oldest first, each with its process's ``pid``."""
    events: list[dict[str, object]] = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut by a killed process
                event["pid"] = name[: -len(".jsonl")]
                events.append(event)
    events.sort(key=lambda e: float(e["t"]))  # type: ignore[arg-type]
    return events
