"""docs/reliability.md, written from the last run of `python -m kvpush_bench faults`, `soak`
and `fuzz`.

Each command stores its result under its own key of ``docs/reliability.json`` and the
page is rendered again from all three, so every section shows its own last run.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

import kvpush

# The "Trust boundaries" section, kept by hand beside this file: a run of faults / soak /
# fuzz renders the rest of the page anew.
TRUST_BOUNDARIES = Path(__file__).with_name("trust_boundaries.md").read_text().splitlines()


def default_doc() -> Path:
    """docs/reliability.md of the source tree kvpush runs from, else of the current directory."""
    tree = Path(kvpush.__file__).resolve().parents[1] / "docs"
    return (tree if tree.is_dir() else Path.cwd() / "docs") / "reliability.md"


def record(section: str, result: dict[str, Any], doc: Path) -> None:
    """Store ``result`` as the last run of ``section`` and render the page again."""
    store = doc.with_suffix(".json")
    data: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    data[section] = {
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "kvpush " + " ".join(sys.argv[1:]) if sys.argv[1:] else section,
        "machine": f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}",
        "result": result,
    }
    doc.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    doc.write_text(render(data))


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _run_line(entry: dict[str, Any]) -> str:
    return f"Last run {entry['when']} on {entry['machine']}: `{entry['command']}`."


def render(data: dict[str, Any]) -> str:
    out = [
        "# Reliability",
        "",
        "Written by `python -m kvpush_bench faults`, `soak` and `fuzz` from their last runs",
        "(the data is in `reliability.json` next to this page); do not edit by hand.",
        "",
    ]
    out += _faults(data.get("faults"))
    out += _soak(data.get("soak"))
    out += _fuzz(data.get("fuzz"))
    out += TRUST
    out += TRUST_BOUNDARIES
    out += CROSS_HOST
    out += LIMITS
    return "\n".join(out) + "\n"


def _faults(entry: dict[str, Any] | None) -> list[str]:
    out = ["## Fault matrix", ""]
    if entry is None:
        return out + ["Not run yet: `python -m kvpush_bench faults`.", ""]
    r = entry["result"]
    o = r["options"]
    out += [
        _run_line(entry),
        f"**{r['passed']} of {r['cases']} cases as expected** in {r['seconds']} s.",
        "",
        "One P and one D process with real NIXL agents (UCX). Each case injects one fault into",
        "one request, or SIGKILLs P or D at a protocol point, and checks: D's outcome is the",
        "expected one; every surviving side holds no blocks within the bound (lease "
        f"{o['lease_s']} s, watchdog {o['watchdog_s']} s, D's late-write hold "
        f"{o.get('late_write_hold_s', 0)} s, plus {o['slack_s']} s slack); no",
        "writer error; and the survivor serves: a replacement is started for a dead peer and",
        "two more requests are pushed and verified byte for byte. *Freed* is the time from",
        "the fault until each side held no blocks (the case's own blocks included).",
        "",
        "| case | protocol point | fault | dies | expected (D) | outcome (D) | P's WRITE "
        "| freed P / D (s) | bound (s) | survivor serves | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        if "error" in row:
            out.append(
                f"| {row['case']} | {row['point']} | {row['fault']} | | | "
                f"error: {row['error']} | | | | | **no** |"
            )
            continue
        freed = row["freed_s"]
        f = " / ".join("-" if s not in freed else str(freed[s]) for s in ("P", "D"))
        expected = row["expected"].replace("|", " or ")  # a bare | would split the cell
        out.append(
            f"| {row['case']} | {row['point']} | {row['fault']} | {row['victim']} "
            f"| {expected} | {row['outcome']} | {row['write']} | {f} | {row['bound_s']} "
            f"| {'yes' if row['survivor_ok'] else '**no**'} | {'yes' if row['ok'] else '**no**'} |"
        )
    return out + [""]


def _soak(entry: dict[str, Any] | None) -> list[str]:
    out = ["## Soak", ""]
    if entry is None:
        cmd = "python -m kvpush_bench soak --requests 10000 --fault-rate 0.05"
        return out + [f"Not run yet: `{cmd}`.", ""]
    r = entry["result"]
    o = r["options"]
    out += [
        _run_line(entry),
        "",
        f"{r['requests']} requests between a P and a D process over real NIXL, "
        f"{o['window']} in flight, 1-{o['max_blocks']} blocks each, a fraction "
        f"{r['fault_rate']} of them faulted (lease {o['lease_s']} s, watchdog "
        f"{o['watchdog_s']} s). Hung: no outcome on D, or P's blocks not freed, within "
        f"{o['request_timeout_s']} s. Leaked: blocks still held on P and D after settling. "
        "Crashes: tick errors, dead keeper threads, dead processes.",
        "",
        "| requests | completed | failed | released (aborted) | hung | leaked blocks | crashes "
        "| corrupted | completion rate | unfaulted completion rate | requests/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {r['requests']} | {r['completed']} | {r['failed']} | {r['released']} | {r['hung']} "
        f"| {r['leaked_blocks']} | {r['crashes']} | {r['corrupted']} | {r['completion_rate']} "
        f"| {r['clean_completion_rate']} | {r['requests_per_s']} |",
        "",
        "Faulted requests by fault (" + f"{r['faulted_requests']} in all, "
        f"{r['faulted_completed']} of them completed anyway): "
        + ", ".join(f"{k} {v}" for k, v in r["faults"].items())
        + ".",
        "",
        "Why D's receives failed: "
        + (", ".join(f"{k} ({v})" for k, v in r["failure_reasons"].items()) or "none")
        + ".",
        "",
    ]
    return out


def _fuzz(entry: dict[str, Any] | None) -> list[str]:
    out = ["## Fuzz", ""]
    if entry is None:
        return out + ["Not run yet: `python -m kvpush_bench fuzz --inputs 100000`.", ""]
    r = entry["result"]
    out += [
        _run_line(entry),
        "",
        "Hostile notifications delivered into the inboxes of a live P and D worker (in-memory",
        "transport) under D's, P's or made-up sender names; every registration is invalid in",
        "at least one way (bit-flipped ones, which a flip may mend, come from a stranger), so",
        "none may be written. *Rejected*: the strict decoder refused it. *Ignored*: decoded, then",
        "dropped or answered by a handler (duplicate, invalid, wrong sender, unknown request…).",
        "",
        "| inputs | rejected | accepted | ignored by handlers | crashes | writes caused "
        "| tick errors | keepers alive | inputs/s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['inputs']} | {r['rejected']} | {r['accepted']} | {r['ignored']} | {r['crashes']} "
        f"| {r['writes_caused']} | {r['writer_errors']} | {r['writers_alive']} "
        f"| {r['inputs_per_s']} |",
        "",
        "Inputs by kind: " + ", ".join(f"{k} {v}" for k, v in r["categories"].items()) + ".",
        "",
        "How registrations were broken (1-3 ways each): "
        + ", ".join(f"{k} {v}" for k, v in r["registration_breaks"].items())
        + ".",
        "",
        "Handled: " + (", ".join(f"{k} {v}" for k, v in r["handled"].items()) or "-") + ".",
        "",
    ]
    return out


TRUST = [
    "## Trust: who gets the handshake answer",
    "",
    'With `KVPUSH_SHARED_SECRET` set (operating.md, "Trust set-up"). Checked by',
    "`tests/integration/test_auth.py` against real P, D and exporter processes (real NIXL;",
    "the exporter's answer holds CUDA IPC handle bytes), asserting on every byte the rogue",
    "received, and by `tests/unit/test_handshake.py` / `test_trust.py`.",
    "",
    "| case | the rogue | it receives | counted as | honest peers |",
    "|---|---|---|---|---|",
    "| no secret | says hello, answers the challenge without a MAC | a challenge and a "
    "short refusal: no NIXL metadata, no IPC handle bytes, no agent name | "
    "`handshake_refused_no_secret` | push, verified byte for byte |",
    "| wrong secret | answers the challenge with a MAC under another secret | the same | "
    "`handshake_refused_bad_mac` | push |",
    "| replayed exchange | replays, byte for byte, what D sent in a captured honest handshake "
    "| a fresh challenge and a refusal (the captured challenge was used) | "
    "`handshake_refused_replay` | push |",
    "| expired challenge | answers a challenge after its 10 s | a refusal | "
    "`handshake_refused_replay` | - |",
    "| old protocol, garbage | sends it | a short refusal "
    "(a version-1 client reads it as one) | `version`, `malformed` | - |",
    "| over 4 KiB | announces a longer request (up to 1 GiB) | a short refusal before any of "
    "its bytes is read, then the connection closed | `oversized` | served |",
    "| a request that never ends | sends part of one and goes quiet | nothing; the server "
    "holds those bytes (4 KiB at most) until it closes the connection after 10 s | "
    "`handshake_dropped_idle` | served |",
    "| idle connections | opens 192 and sends nothing | the oldest closed for each new one "
    "beyond 64 | `handshake_dropped_crowded` | served |",
    "| requests without reading answers | sends hellos until its socket buffers fill | "
    "one answer at a time; the server reads nothing more until it is taken | - | served |",
    "| hostile server (to a client) | announces a 2 GiB answer, or 1 MiB and sends 10 bytes | "
    "(the client) a failed handshake at once, or at its timeout, holding what it was sent "
    "| - | - |",
    "| server without the proof | answers the info without a challenge, or a bad MAC | "
    "(the client) accepts nothing: the handshake fails | - | - |",
    "| forged notifications | a NIXL agent holding P's and D's metadata but no handshake sends "
    "`PUSH_REG`, `PUSH_CANCEL`, heartbeats to P and a completion and `PUSH_FAIL` to D | "
    "nothing acted on: P keeps no forged registration, D's receive is not ended | "
    "`notif_unauthenticated` | the push completes, verified |",
    "| no secret configured | anyone reaching the port | the whole answer, as before; a "
    "start-up warning says so | - | - |",
    "",
]


CROSS_HOST = [
    "## Across hosts (veth link)",
    "",
    "Not written by these scripts: `tests/e2e/test_cross_host.py` (CI, as root) runs real",
    "vLLM servers for P and D on two test hosts (`tests/e2e/hosts.py`: a network namespace",
    "and a private `/dev/shm` each, UCX on TCP over one veth pair, the router in the root",
    "namespace), lease 4 s, watchdog 4 s, heartbeats 0.5 s, `net.ipv4.tcp_retries2=3` in",
    "both namespaces. Figures from runs on 2026-12-01 (2 CPUs). The kernel has no `netem`:",
    "no added delay or loss is tested.",
    "",
    "| case | fault | what must hold | seen |",
    "|---|---|---|---|",
    "| across the link | none: 60 / 450 / streamed 300-token prompts, a chat | token-identical"
    " to a plain server; P's bytes sent = D's received = prompt blocks x 128 KiB; at least"
    " as many bytes left P's link device; no push failures; nothing held | yes |",
    "| slow link under a burst | `tc tbf` 100 Mbit/s; 12 requests at once (60-467 tokens) |"
    " all complete, identical, within the router's 20 s; nothing held within lease + 5 s |"
    " yes (under 1 s) |",
    "| link cut mid-transfer, restored | 2 Mbit/s link, 3 x 450-token requests; link down"
    " once 64 KiB of KV crossed it | each client gets 502 with D's error within watchdog +"
    " 6 s; P and D hold no blocks within lease + 6 s *with the link still down*; P counts 3"
    " push failures; after link up 3 new requests identical, nothing held | yes: 502 after"
    " 0.6-4.4 s, both sides free by then (8 cuts in a row on one pair of servers, every"
    " later request identical; one late completion at D: a PUSH_REG held up by the cut"
    " reached P after D's watchdog, in a run before D held such blocks) |",
    "",
    "What the cut showed on the way there: (1) P held the blocks of its stuck WRITEs for the "
    "whole outage (45 s) and beyond; now at lease expiry P disconnects a D silent for 2 s or more"
    " and the WRITEs end in error. (2) With the kernel's TCP defaults, bytes of those WRITEs "
    "reached D's memory once the link healed, after D had freed the blocks at its watchdog (D "
    "logged 'completion for unknown request'; one e2e run of about ten failed its check of the "
    "requests after the link came back). NIXL's disconnect does not stop them: in a raw NIXL "
    "check over the same link, with both agents removed, the healed link still delivered 40 KB "
    "into D's buffer. With `tcp_retries2=3` the kernel aborts the connection within about 3 s of "
    "silence and nothing arrived late. Hence D's hold on such blocks "
    '(operating.md, "Partitions"):',
    "`tests/e2e/test_partition_hold.py` cuts the link as above with the kernel's default",
    "`tcp_retries2` (15) and a 30 s `late_write_hold_s`: the clients get 502 within the",
    "watchdog, P frees within its lease, D holds the three requests' blocks, requests after",
    "the link is back are identical, and D frees the blocks once the hold ends (34 s after",
    "the cut in its first run).",
    "",
]


LIMITS = [
    "## Known limits",
    "",
    "- **A late WRITE is held off for a bounded time.** A receive that expires while a P",
    "  rank may still be writing (its cancel went out, no answer came: lost heartbeats, a",
    "  partition, a frozen P) fails at once, but D keeps its blocks for `late_write_hold_s`",
    "  (default: the kernel's give-up time for a silent TCP connection, from",
    "  `net.ipv4.tcp_retries2`; about 924.6 s for the default 15). Bytes that arrive later",
    "  than that (a hold set below the network's give-up time, or a P frozen for longer)",
    "  can still land in reused blocks. A source D can no longer reach at all counts as",
    "  unable to write, so a dead P costs no hold; if P and D hosts disagree on",
    "  `tcp_retries2`, D's side decides.",
    "- **A failed handshake fails every push waiting on it.** In the soak, `peer_reset` makes P",
    "  forget D and fail its next handshake; requests deferred behind it fail on D's",
    "  watchdog. That is why the unfaulted completion rate can be below 1.",
    "- **Registrations are bounded in time and in ids, not per sender.** P keeps a registration",
    "  it cannot match for `registration_ttl_s`, and the waiting ones hold at most 4,194,304 of",
    "  D's block ids in all (`reg_over_budget`: refused at once past it). With",
    "  `trusted_decoders` set, P refuses (and never contacts) any decoder address not on the",
    "  list, before storing anything; without it, any sender's registration is kept until its",
    "  TTL and its address is handshaken, and without a shared secret one rogue agent can fill",
    "  the budget, so that honest registrations are refused until its own expire. NIXL takes in",
    "  a notification whole before kvpush sees its size (over 4 MiB it is then dropped): a rogue",
    "  agent's 256 MiB notifications raised P's memory by that much while they were handled.",
    "  Set a shared secret: the side channel then gives NIXL metadata only to its holders.",
    "- **Notifications are not authenticated one by one.** Agents are: with a shared secret",
    "  both sides of a handshake prove it, and notifications are acted on only from agent",
    "  names that did. But a completion or `PUSH_FAIL` under an authenticated P agent's name",
    "  is believed: the fuzzer sends some for D's live receives, and D ends them (done without",
    "  data, or failed). No crash and no WRITE follow. Sending under such a name takes that",
    "  agent's NIXL metadata, which the side channel gives only to holders of the secret.",
    "- **vLLM servers killed mid-request** are covered by `tests/e2e/test_vllm_faults.py`",
    "  (not by this script): a killed decoder gives the client an error within the router's",
    "  timeout and the prefiller frees its blocks within the lease; a killed prefiller fails",
    "  decode requests within the handshake timeout / watchdog and the decoder frees its",
    "  blocks; each survivor serves new requests once its peer is restarted.",
    "- **The peer-copy path (CUDA IPC, same host) is not in this matrix** (CPU machines have",
    "  no CUDA). Its failures are unit-tested over the in-memory transport (a failed copy",
    "  fails the transfer with `PUSH_FAIL` and frees both sides; a declined one WRITEs). P",
    "  writes D's memory through a mapping: a decoder that exits while P copies into it can",
    "  leave P's CUDA context with an illegal-address error.",
    "",
]
