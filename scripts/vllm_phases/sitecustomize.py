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


_KV_METHODS = (
    "start_load_kv",
    "wait_for_save",
    "get_transfer_results",
    "save_kv_layer",
    "wait_for_layer_load",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "bind_connector_metadata",
)


def _hook(runner):
    """Wrap the runner's parts once they exist (the KV connector is set after the
    profiling run): each object once, found again on every call."""
    kv = getattr(runner, "kv_connector", None)
    hooks = (
        (getattr(runner, "model_state", None), ("prepare_attn", "prepare_inputs"), "ms."),
        (kv, ("pre_forward", "finish_forward", "post_forward", "no_forward"), "kv."),
        (getattr(kv, "kv_connector", None), _KV_METHODS, "conn."),
        (getattr(runner, "model", None), ("forward",), "model."),
        (getattr(runner, "block_tables", None), ("apply_staged_writes",), "bt."),
    )
    for obj, names, pre in hooks:
        if obj is None or getattr(obj, "_phases_wrapped", False):
            continue
        try:
            obj._phases_wrapped = True
        except Exception:
            continue
        for n in names:
            if hasattr(obj, n):
                setattr(obj, n, _wrap(getattr(obj, n), pre + n))


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
        _hook(self)
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
            _st.last_new = d["new"]
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
            d["after_new"] = getattr(_st, "last_new", 0)
            _st.last_new = 0
            if d["sample_tokens"] > 1.0 or d["after_new"]:
                out.write(json.dumps(d) + "\n")

    R.sample_tokens = stk
    out.write(json.dumps({"patched": mod.__name__, "pid": os.getpid()}) + "\n")


_seen: dict[str, set] = {}
_out = None
_olock = threading.Lock()


def _mark(ev, rids, **extra):
    """Log `ev` for the request ids seen with this event for the first time."""
    global _out
    fresh = [r for r in rids if r not in _seen.setdefault(ev, set())]
    if not fresh:
        return
    _seen[ev].update(fresh)
    with _olock:
        if _out is None:
            _out = open(os.path.join(_DIR, f"outpath-{os.getpid()}.jsonl"), "a", buffering=1)
        _out.write(json.dumps({"t": time.time(), "ev": ev, "rids": fresh, **extra}) + "\n")


def _rids(outs):
    return [o.request_id for o in (getattr(outs, "outputs", None) or ()) if o.new_token_ids]


def _patch_core(mod):
    C = mod.EngineCore

    def wrap_step(f):
        def w(self, *a, **k):
            res = f(self, *a, **k)
            for outs in (res[0] or {}).values():
                _mark("core.step_out", _rids(outs))
            return res

        return w

    for n in ("step", "step_with_batch_queue"):
        if hasattr(C, n):
            setattr(C, n, wrap_step(getattr(C, n)))
    fadd = C.add_request

    def add_request(self, request, *a, **k):
        _mark("core.add", [request.request_id])
        return fadd(self, request, *a, **k)

    C.add_request = add_request
    P = mod.EngineCoreProc
    send = P._send_msg_tracking_payload

    def sent(*a, **k):
        res = send(*a, **k)
        _mark("core.sent", list(getattr(_st, "enc", ())))
        return res

    P._send_msg_tracking_payload = staticmethod(sent)


def _patch_serial(mod):
    enc, dec = mod.MsgpackEncoder.encode_into, mod.MsgpackDecoder.decode

    def encode_into(self, obj, buf):
        _st.enc = _rids(obj)
        _mark("core.encode", _st.enc)
        return enc(self, obj, buf)

    def decode(self, bufs):
        obj = dec(self, bufs)
        _mark("api.decoded", _rids(obj))
        return obj

    mod.MsgpackEncoder.encode_into, mod.MsgpackDecoder.decode = encode_into, decode


def _patch_sched(mod):
    f = mod.Scheduler.schedule

    def schedule(self, *a, **k):
        out = f(self, *a, **k)
        _mark("core.sched", [r.req_id for r in out.scheduled_new_reqs])
        return out

    mod.Scheduler.schedule = schedule


def _patch_outproc(mod):
    fadd = mod.OutputProcessor.add_request

    def add_request(self, request, *a, **k):
        _mark("api.add", [request.request_id], n=len(request.prompt_token_ids or ()))
        return fadd(self, request, *a, **k)

    mod.OutputProcessor.add_request = add_request
    f = mod.OutputProcessor.process_outputs

    def process_outputs(self, outs, *a, **k):
        rids = [o.request_id for o in outs if o.new_token_ids]
        _st.proc = rids
        _mark("api.process", rids)
        res = f(self, outs, *a, **k)
        _mark("api.processed", rids)
        return res

    mod.OutputProcessor.process_outputs = process_outputs


def _patch_serving(mod):
    S = mod.OpenAIServingCompletion
    gen, full = S.completion_stream_generator, S.request_output_to_completion_response

    async def stream(self, request, engine_inputs, results, request_id, *a, **k):
        async for chunk in gen(self, request, engine_inputs, results, request_id, *a, **k):
            _mark("api.first_chunk", [request_id])
            yield chunk

    def answer(self, *a, **k):
        res = full(self, *a, **k)
        _mark("api.answer", [getattr(res, "id", "")])
        return res

    S.completion_stream_generator, S.request_output_to_completion_response = stream, answer


def _patch_loggers(mod):
    f = mod.StatLoggerManager.record

    def record(self, *a, **k):
        rids = list(getattr(_st, "proc", ()))
        _mark("api.record", rids)
        res = f(self, *a, **k)
        _mark("api.recorded", rids)
        return res

    mod.StatLoggerManager.record = record


_OUT_MODS = {
    "vllm.v1.metrics.loggers": _patch_loggers,
    "vllm.v1.engine.core": _patch_core,
    "vllm.v1.core.sched.scheduler": _patch_sched,
    "vllm.v1.serial_utils": _patch_serial,
    "vllm.v1.engine.output_processor": _patch_outproc,
    "vllm.entrypoints.openai.completion.serving": _patch_serving,
}


def _patch_any(name, module):
    try:
        if name in _OUT_MODS:
            _OUT_MODS[name](module)
        else:
            _patch(module)
    except Exception as exc:  # diagnosis must not break the server
        print("phases: patch failed", name, repr(exc), file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _MODS and name not in _OUT_MODS:
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
            _patch_any(name, module)

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
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_poll, daemon=True, name="phases-poll").start()
