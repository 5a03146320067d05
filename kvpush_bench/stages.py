"""Where a kvpush request's time goes: stage marks (kvpush.core.trace) lined up with the
client's own send time and its first and second tokens.

Every mark carries the transfer id, the request id, or both; D's marks that know only
its request id are tied to the transfer through ``d_sched.alloc`` (which has both).
Offsets are in ms from the moment the client sent the request.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kvpush_bench.stats import summary

# In the order a request normally passes them (P and D run side by side).
STAGES = (
    "router.recv",  # the router read the client's request
    "p_sched.alloc",  # P's scheduler allocated the prefill request
    "d_sched.matched",  # D's scheduler saw the decode request (remote KV expected)
    "d_sched.alloc",  # D allocated its blocks: the registration exists
    "RecvTransfer.awaiting",  # D's worker sent PUSH_REG
    "p_producer.reg",  # P's worker read PUSH_REG
    "p_sched.hand_over",  # P's scheduler handed the prefill over (its forward is next)
    "p_worker.save",  # P's forward launched (wait_for_save): push queued behind its event
    "p_producer.launch",  # P launched the copy (behind the forward's event)
    "PushTransfer.writing",
    "RecvTransfer.done",  # D's worker saw the KV (lane word or completion)
    "d_worker.report",  # D's worker reported it to vLLM (finished_recving)
    "d_sched.recvd",  # D's scheduler took it in
    "d_sched.forward",  # D's scheduler scheduled the request's first forward
    "d_sched.output",  # that step's output (the first token) reached D's scheduler
    "router.p_piece",  # the first piece of P's answer reached the router
    "router.p_head",  # the router had P's first events whole (its head for the client)
    "router.p_answer",  # P's whole answer reached the router (its engine's output path done)
    "router.first_chunk",  # D's first event reached the router
    "router.prepared",  # the router sent the client its headers (the event follows)
    "router.d_piece",  # after P's head went out: D's first piece (its copy of that token)
    "PushTransfer.done",  # P saw its push end
    "sched.finished",  # a scheduler finished the request (P's first, then D's)
)


def transfer_of(events: list[dict[str, Any]]) -> dict[str, str]:
    """request id -> transfer id, from the first mark that carries both."""
    tid_of: dict[str, str] = {}
    for e in events:
        if e.get("id") and e.get("rid"):
            tid_of.setdefault(str(e["rid"]), str(e["id"]))
    return tid_of


def by_transfer(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """transfer id -> stage -> wall time of its first mark."""
    tid_of = transfer_of(events)
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for e in events:
        tid = e.get("id") or tid_of.get(str(e.get("rid")))
        if tid:
            out[str(tid)].setdefault(str(e["ev"]), float(e["t"]))
    return out


def breakdown(samples: list[Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage: the median (and p90) offset from the client's send over ``samples``
    (objects with ``request_id``, ``sent_at``, ``ok``, ``ttft_s`` and optionally
    ``second_s``); the client's first and second tokens last. Stages no sample reached are
    left out."""
    marks = by_transfer(events)
    offsets: dict[str, list[float]] = defaultdict(list)
    traced = 0
    for s in samples:
        m = marks.get(s.request_id)
        if not s.ok or not s.sent_at or m is None:
            continue
        traced += 1
        for stage, t in m.items():
            offsets[stage].append((t - s.sent_at) * 1e3)
        offsets["client.first_token"].append(s.ttft_s * 1e3)
        if getattr(s, "second_s", 0.0):
            offsets["client.second_token"].append(s.second_s * 1e3)
    client = ("client.first_token", "client.second_token")
    order = [*STAGES, *sorted(set(offsets) - set(STAGES) - set(client))]
    stages = {st: summary(offsets[st], 2) for st in [*order, *client] if offsets.get(st)}
    return {"traced_requests": traced, "offset_ms": stages}


# Per-step marks (no transfer id): vLLM's steps on each side while a request is traced.
STEP_EVENTS = ("sched.step", "sched.update", "worker.start", "worker.save", "worker.collect")


def timelines(samples: list[Any], events: list[dict[str, Any]], keep: int = 3) -> list[Any]:
    """For the first ``keep`` traced samples: every mark of its transfer and every step
    mark of P's and D's processes from the client's send to its second token (its first
    when there is none) +2 ms, as
    ``[ms from send, side, event, n]`` in time order (side: P, D, router or ?)."""
    marks = by_transfer(events)
    tid_of = transfer_of(events)
    side_of: dict[str, str] = {}
    for e in events:
        ev = str(e["ev"])
        if e.get("pid") and ev.startswith(("p_", "d_", "router.")):
            side_of.setdefault(str(e["pid"]), {"p": "P", "d": "D", "r": "router"}[ev[0]])
    out: list[Any] = []
    for s in samples:
        m = marks.get(s.request_id)
        if not s.ok or not s.sent_at or m is None:
            continue
        second = getattr(s, "second_s", 0.0)
        end = s.sent_at + max(s.ttft_s, second) + 0.002
        rows = []
        for e in events:
            t = float(e["t"])
            if not s.sent_at <= t <= end:
                continue
            tid = e.get("id") or tid_of.get(str(e.get("rid")))
            if tid == s.request_id or (e.get("ev") in STEP_EVENTS and tid is None):
                side = side_of.get(str(e.get("pid")), "?")
                rows.append([round((t - s.sent_at) * 1e3, 3), side, e["ev"], e.get("n")])
        rows.append([round(s.ttft_s * 1e3, 3), "client", "first_token", None])
        if second:
            rows.append([round(second * 1e3, 3), "client", "second_token", None])
        out.append(sorted(rows, key=lambda r: r[0]))
        if len(out) >= keep:
            break
    return out
