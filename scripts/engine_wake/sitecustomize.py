"""A bench-only counterfactual (issue 38 item 3): a vLLM engine whose idle wait is shorter.

vLLM 0.32's EngineCore sleeps 1 ms after every step that ran no model while it still holds
requests (``_process_engine_step``: requests waiting for remote KV, for one), so a decoder
whose requests all wait for KV steps about every 1.6 ms and sees a finished transfer at
its next step. With this directory first on PYTHONPATH and KVPUSH_BENCH_ENGINE_IDLE_SLEEP
set (seconds; 0 only yields the GIL), that sleep lasts so long instead: what the second
token would gain if vLLM woke its engine when a transfer finished. With
KVPUSH_BENCH_SWITCH_INTERVAL (seconds) the process's GIL switch interval is that instead of
CPython's 5 ms. Both change vLLM's behaviour, so they live here for measurements, never in
the product (kvpush_bench.vllm_gpu's --decode-env and --env set them for one contender).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from types import ModuleType
from typing import Any

_ENGINE = "vllm.v1.engine.core"
_VLLM_IDLE_SLEEP = 0.001  # the literal in vLLM 0.32's _process_engine_step


class _Clock:
    """``time`` for the engine module alone: its idle sleep shortened, all else the same."""

    def __init__(self, idle: float) -> None:
        self.idle = idle

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(self.idle if seconds == _VLLM_IDLE_SLEEP else seconds)


class _Patch(importlib.abc.MetaPathFinder):
    def __init__(self, idle: float) -> None:
        self.idle = idle

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != _ENGINE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module  # type: ignore[union-attr]
        idle = self.idle

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.time = _Clock(idle)  # type: ignore[attr-defined]
            print(f"[engine_wake] {_ENGINE}: idle sleep {idle} s", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module  # type: ignore[union-attr,method-assign]
        return spec


_idle = os.environ.get("KVPUSH_BENCH_ENGINE_IDLE_SLEEP")
if _idle is not None:
    sys.meta_path.insert(0, _Patch(float(_idle)))
# A thread that wakes (vLLM's output thread, say) waits for the GIL until the running thread
# gives it up or this interval passes (CPython's default 5 ms): a shorter one tests whether
# an output waits behind the engine thread's Python work.
_switch = os.environ.get("KVPUSH_BENCH_SWITCH_INTERVAL")
if _switch is not None:
    sys.setswitchinterval(float(_switch))
    print(f"[engine_wake] switch interval {_switch} s", file=sys.stderr, flush=True)
