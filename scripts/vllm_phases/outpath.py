"""Diagnosis only: read the outpath-<pid>.jsonl files sitecustomize.py writes and print,
per server (an API process and its engine core), the median and p90 time in ms between
consecutive stages of each request's first output, from the engine step that produced
it to the first chunk (streamed) or the answer (not streamed) leaving the API server.

    python3 scripts/vllm_phases/outpath.py DIR
"""

import collections
import glob
import json
import os
import statistics
import sys

_LAST = ("api.first_chunk", "api.answer")


def _load(d: str) -> dict[int, list[dict]]:
    out = {}
    for f in glob.glob(os.path.join(d, "outpath-*.jsonl")):
        pid = int(f.rsplit("-", 1)[1].split(".")[0])
        with open(f) as fh:
            out[pid] = [json.loads(line) for line in fh if line.strip()]
    return out


def _roles(d: str) -> dict[int, str]:
    """Core pid -> connector role, from the phases-<pid>.jsonl lines the same probe writes."""
    roles = {}
    for f in glob.glob(os.path.join(d, "phases-*.jsonl")):
        pid = int(f.rsplit("-", 1)[1].split(".")[0])
        with open(f) as fh:
            for line in fh:
                role = json.loads(line).get("role")
                if role:
                    roles[pid] = role
                    break
    return roles


def _firsts(evs: list[dict]) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """rid -> stage -> first time, and rid -> prompt tokens (where api.add saw it)."""
    by: dict[str, dict[str, float]] = collections.defaultdict(dict)
    size: dict[str, int] = {}
    for e in evs:
        for r in e["rids"]:
            by[r].setdefault(e["ev"], e["t"])
            if "n" in e:
                size[r] = e["n"]
    return by, size


_ORDER = (
    "api.add", "core.add", "core.sched", "core.step_out", "core.encode", "core.sent",
    "api.decoded", "api.process", "api.processed", "api.record", "api.recorded", "out",
)  # fmt: skip


def _report(title: str, reqs: list[dict[str, float]]) -> None:
    print(f"{title}: {len(reqs)} requests")
    for a, b in zip(_ORDER, _ORDER[1:], strict=False):
        v = sorted((st[b] - st[a]) * 1e3 for st in reqs if a in st and b in st)
        if v:
            p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
            print(f"  {a:>14s} -> {b:14s} p50 {statistics.median(v):7.3f}  p90 {p90:7.3f}")
    for a in ("api.add", "core.sched", "core.step_out"):
        v = sorted((st["out"] - st[a]) * 1e3 for st in reqs if a in st and "out" in st)
        if v:
            print(f"  {a:>14s} -> out (total)   p50 {statistics.median(v):7.3f}")


def main(d: str) -> None:
    files, roles = _load(d), _roles(d)
    parsed = {p: _firsts(e) for p, e in files.items()}
    core = {p: v for p, v in parsed.items() if any(x["ev"].startswith("core.") for x in files[p])}
    api = {p: v for p, v in parsed.items() if p not in core}
    for apid, (arids, sizes) in sorted(api.items()):
        bases = {r: st for r, st in arids.items() if any(s in st for s in _LAST)}
        for cpid, (crids, _) in sorted(core.items()):
            shared = set(crids) & set(arids)
            if not shared:
                continue
            by_size: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
            for rid in sorted(shared):
                st = dict(crids[rid])
                st.update(arids[rid])
                base = next((b for b in bases if rid.startswith(b + "-")), None)
                if base is not None:
                    st.update(bases[base])
                ends = [st[s] for s in _LAST if s in st]
                if not ends:
                    continue
                st["out"] = min(ends)
                by_size[sizes.get(rid, 0)].append(st)
            for n, reqs in sorted(by_size.items()):
                _report(f"api {apid} / core {cpid} ({roles.get(cpid, '?')}), {n} tokens", reqs)


if __name__ == "__main__":
    main(sys.argv[1])
