"""Diagnosis only, not part of kvpush: time vLLM's model-runner phases (V2 on GPUs, V1
elsewhere) per step in every process that has this directory first on PYTHONPATH, and log
the steps that schedule a new request or take over 1 ms to VLLM_PHASES_LOG/phases-<pid>.jsonl
(docs/benchmarks.md, run 12). Without VLLM_PHASES_LOG it does nothing."""

import importlib.abc
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("VLLM_PHASES_LOG")
_MODS = ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner")
_st = threading.local()


def _acc(name, t0):
    d = getattr(_st, "d", None)
    if d is not None:
        d[name] = round(d.get(name, 0.0) + (time.perf_counter() - t0) * 1e3, 3)


def _wrap(f, name):
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _acc(name, t0)

    return w


def _patch(mod):
    if getattr(mod, "_phases_patched", False):
        return
    mod._phases_patched = True
    R = mod.GPUModelRunner
    out = open(os.path.join(_DIR, f"phases-{os.getpid()}.jsonl"), "a", buffering=1)
    for n in [
        "finish_requests",
        "free_states",
        "add_requests",
        "update_requests",
        "gather_batch_req_state",
        "prepare_inputs",
        "prepare_attn",
        "_update_states",
        "_prepare_inputs",
        "_build_attention_metadata",
        "_preprocess",
        "_model_forward",
        "sample",
        "postprocess_sampled",
    ]:
        if hasattr(R, n):
            setattr(R, n, _wrap(getattr(R, n), n))
    if hasattr(mod, "dispatch_cg_and_sync_dp"):
        mod.dispatch_cg_and_sync_dp = _wrap(mod.dispatch_cg_and_sync_dp, "dispatch_cg")
    fex = R.execute_model

    def ex(self, so, *a, **k):
        if not getattr(self, "_phases_wrapped", False):
            self._phases_wrapped = True
            hooks = (
                (getattr(self, "model_state", None), ("prepare_attn", "prepare_inputs"), "ms."),
                (
                    getattr(self, "kv_connector", None),
                    ("pre_forward", "finish_forward", "no_forward"),
                    "kv.",
                ),
                (getattr(self, "block_tables", None), ("apply_staged_writes",), "bt."),
            )
            for obj, names, pre in hooks:
                for n in names:
                    if obj is not None and hasattr(obj, n):
                        setattr(obj, n, _wrap(getattr(obj, n), pre + n))
        if k.get("dummy_run"):
            return fex(self, so, *a, **k)
        _st.d = {}
        t0 = time.perf_counter()
        try:
            return fex(self, so, *a, **k)
        finally:
            d = _st.d
            _st.d = None
            d["execute_model"] = round((time.perf_counter() - t0) * 1e3, 3)
            d["t"] = time.time()
            d["new"] = len(so.scheduled_new_reqs)
            d["tokens"] = so.total_num_scheduled_tokens
            kv = self.vllm_config.kv_transfer_config
            d["role"] = f"{kv.kv_connector}:{kv.kv_role}" if kv else "plain"
            if d["new"] or d["execute_model"] > 1.0:
                out.write(json.dumps(d) + "\n")

    R.execute_model = ex
    fst = R.sample_tokens

    def stk(self, *a, **k):
        _st.d = {}
        t0 = time.perf_counter()
        try:
            return fst(self, *a, **k)
        finally:
            d = _st.d
            _st.d = None
            d["sample_tokens"] = round((time.perf_counter() - t0) * 1e3, 3)
            d["t"] = time.time()
            if d["sample_tokens"] > 1.0:
                out.write(json.dumps(d) + "\n")

    R.sample_tokens = stk
    out.write(json.dumps({"patched": mod.__name__, "pid": os.getpid()}) + "\n")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _MODS:
            return None
        for f in sys.meta_path:
            if f is self or not hasattr(f, "find_spec"):
                continue
            spec = f.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        orig = spec.loader.exec_module

        def exec_module(module):
            orig(module)
            try:
                _patch(module)
            except Exception as exc:  # diagnosis must not break the server
                print("phases: patch failed", repr(exc), file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


def _poll():
    # Fallback if the import hook is bypassed: patch the modules once they are loaded.
    for _ in range(12000):
        for name in _MODS:
            mod = sys.modules.get(name)
            if mod is not None and hasattr(mod, "GPUModelRunner"):
                try:
                    _patch(mod)
                except Exception as exc:
                    print("phases: patch failed", repr(exc), file=sys.stderr, flush=True)
        time.sleep(0.05)


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    with open(os.path.join(_DIR, f"loaded-{os.getpid()}.txt"), "w") as f:
        f.write(" ".join(sys.argv)[:300] + "\n")
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_poll, daemon=True, name="phases-poll").start()
