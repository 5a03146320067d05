"""The three P/D pairs the engine-level benchmark compares, each driven as its proxy drives it.

- ``kvpush``: kvpush's connector on both servers, kvpush's router in front; the router sends
  the prefill leg and the decode leg at the same time (``transfer_id`` matching).
- ``push``: vLLM's in-tree ``NixlPushConnector``, driven from this client: the prefill leg
  (``max_tokens=1``, ``do_remote_decode``) and the streamed decode leg
  (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``tp_size``) sent at the same time with the same ``X-Request-Id``, as
  the in-tree push scheduler matches P and D by request id. (Our router's
  ``--decode-kv-extra`` cannot do it: vLLM 0.32 needs a per-request ``remote_request_id``
  on the decode leg, and its engine dies without it.)
- ``pull``: vLLM's in-tree ``NixlConnector``, driven from this client the way vLLM's
  disaggregated proxy drives it: the prefill leg (``max_tokens=1``,
  ``do_remote_decode``) first, then the streamed decode leg with the ``kv_transfer_params``
  P returned, both with the same ``X-Request-Id``.

No proxy process sits in front of the in-tree pairs, so they pay one HTTP hop less than
kvpush, whose numbers include its router.

Every server gets its own core for its OpenMP threads (CPU) and vLLM's defaults otherwise,
prefix caching on; a contender's flags can add to them (``plain-nocache`` below).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.deploy.client import request
from kvpush.deploy.servers import (
    Proc,
    RouterProc,
    ServerSpec,
    VllmServer,
    default_device,
    free_port,
    kvpush_config,
    wait_healthy,
)

CONFIGS = ("kvpush", "push", "pull")
LABELS = {
    "plain": "one plain vLLM server (no disaggregation)",
    "plain-nocache": "one plain vLLM server, prefix caching off",
    "kvpush": "kvpush (router, both legs at once)",
    "push": "vLLM NixlPushConnector (client, both legs at once)",
    "pull": "vLLM NixlConnector (client, prefill then decode)",
}


@dataclass
class Sample:
    """One client request: time to first token and to the last byte, from the client."""

    ok: bool
    ttft_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    error: str = ""
    request_id: str = ""  # the X-Request-Id the answer carried (kvpush: the transfer id)
    sent_at: float = 0.0  # wall clock at send (lines the sample up with stage traces)
    second_s: float = 0.0  # time to the second token (the event after the first)


class Pair(ABC):
    """A prefiller, a decoder and whatever sits in front of them; started and stopped whole."""

    name: str = ""

    def __init__(self, model: str, log_dir: str, **spec: Any) -> None:
        self.model = model
        self.log_dir = log_dir
        self.spec = spec  # further ServerSpec fields for every server (GPU settings)
        self.procs: list[Proc] = []

    @abstractmethod
    def _launch(self) -> list[Proc]:
        """Start every process (not waiting for health)."""

    @abstractmethod
    def send(self, prompt: list[int], max_tokens: int, timeout: float) -> Sample:
        """One request through the pair, timed from the client."""

    def start(self, timeout: float = 300.0) -> None:
        try:
            self.procs = self._launch()
            wait_healthy(self.procs, timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs = []

    def pause(self) -> None:
        """Freeze every process (SIGSTOP): an idle contender's spinning threads must not
        take CPU from the one being measured. ``resume`` before sending to it."""
        for proc in self.procs:
            proc.send(signal.SIGSTOP)

    def resume(self) -> None:
        for proc in self.procs:
            proc.send(signal.SIGCONT)

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs if p.alive()]

    def _nixl_env(self, side_port: int) -> dict[str, str]:
        return {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        }

    def _launch_in_tree(self, connector: str, p_side_port: int) -> list[Proc]:
        """A prefiller and a decoder with one of vLLM's own NIXL connectors (``<name>-prefill``
        on core 0, ``<name>-decode`` on core 1), P's side channel on ``p_side_port``."""
        prefill, decode = f"{self.name}-prefill", f"{self.name}-decode"
        p_kv = _in_tree(connector, "kv_producer", prefill, self.device)
        self.p = self._server(prefill, p_kv, 0, self._nixl_env(p_side_port))
        d_kv = _in_tree(connector, "kv_consumer", decode, self.device)
        self.d = self._server(decode, d_kv, 1, self._nixl_env(free_port()))
        return [self.p, self.d]

    @property
    def device(self) -> str:
        return str(self.spec.get("device") or default_device())

    def _server(
        self,
        name: str,
        kv: dict[str, Any] | None,
        core: int,
        env: dict[str, str],
        args: list[str] | None = None,
    ) -> VllmServer:
        extra = dict(self.spec)
        env = {**extra.pop("env", {}), **env}
        extra["extra_args"] = [*extra.get("extra_args", []), *(args or [])]
        spec = ServerSpec(
            name, self.model, kv_config=kv, core=core, env=env, log_dir=self.log_dir, **extra
        )
        return VllmServer(spec)


def _stream(
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    timeout: float,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Sample:
    body = {"ignore_eos": True, **(extra or {})}
    r = request(
        url,
        model,
        prompt,
        max_tokens=max_tokens,
        stream=True,
        timeout=timeout,
        headers=headers,
        extra=body,
        token_ids=False,
    )
    ok = r.ok and r.ttft_s > 0
    error = r.error or ("" if ok else "no token")
    return Sample(
        ok, r.ttft_s, r.total_s, r.prompt_tokens, error, r.request_id, r.sent_at, r.second_s
    )


class PlainPair(Pair):
    """The reference: one vLLM server without a connector, prefill and decode in one."""

    name = "plain"

    args: list[str] = []

    def _launch(self) -> list[Proc]:
        self.server = self._server(self.name, None, 0, {}, self.args)
        return [self.server]

    def send(self, prompt: list[int], max_tokens: int, timeout: float) -> Sample:
        return _stream(self.server.url, self.model, prompt, max_tokens, timeout)


class PlainNoCachePair(PlainPair):
    """The reference with prefix caching off: it then skips hashing the prompt's blocks,
    which every server with a KV connector does whatever its caching setting."""

    name = "plain-nocache"
    args = ["--no-enable-prefix-caching"]


class KvpushPair(Pair):
    name = "kvpush"
    options: dict[str, Any] = {}  # kv_connector_extra_config keys (read only)
    decode_args: list[str] = []  # further vLLM flags for the decoder only (read only)
    decode_env: dict[str, str] = {}  # further environment of the decoder only (read only)

    def _launch(self) -> list[Proc]:
        side, opts = free_port(), self.options
        p_config = kvpush_config("kv_producer", "prefill", side, **opts)
        self.p = self._server("prefill", p_config, 0, {})
        d_config = kvpush_config("kv_consumer", "decode", free_port(), **opts)
        self.d = self._server("decode", d_config, 1, dict(self.decode_env), self.decode_args)
        env = dict(self.spec.get("env", {}))
        self.router = RouterProc(self.p.url, self.d.url, f"127.0.0.1:{side}", self.log_dir, env=env)
        return [self.p, self.d, self.router]

    def send(self, prompt: list[int], max_tokens: int, timeout: float) -> Sample:
        return _stream(self.router.url, self.model, prompt, max_tokens, timeout)


def _in_tree(connector: str, role: str, engine_id: str, device: str) -> dict[str, Any]:
    kv = {"kv_connector": connector, "kv_role": role, "engine_id": engine_id}
    if device == "cuda":
        kv["kv_buffer_device"] = "cuda"  # vLLM's NIXL connectors register the GPU KV itself
    return kv


class InTreePushPair(Pair):
    name = "push"

    def _launch(self) -> list[Proc]:
        self.side = free_port()  # D's kv_transfer_params name P's side channel
        return self._launch_in_tree("NixlPushConnector", self.side)

    def send(self, prompt: list[int], max_tokens: int, timeout: float) -> Sample:
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "push-prefill",
            # P's engine id is cmpl-<X-Request-Id>-0-<random>; D cannot know the suffix
            # (P matches registrations by the id without it), so it gets the base.
            "remote_request_id": f"cmpl-{rid}-0",
            "remote_host": "127.0.0.1",
            "remote_port": self.side,
            "tp_size": 1,
        }
        errors: list[str] = []

        def prefill() -> None:
            try:
                _prefill_leg(self.p.url, self.model, prompt, headers, timeout)
            except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
                errors.append(f"prefill: {e!r}")

        leg = threading.Thread(target=prefill, daemon=True)
        leg.start()
        s = _stream(
            self.d.url,
            self.model,
            prompt,
            max_tokens,
            timeout,
            headers,
            {"kv_transfer_params": params},
        )
        leg.join(timeout)
        if errors and s.ok:
            s.error = errors[0]  # the decode leg got its KV anyway; keep the sample
        elif errors:
            s.error = f"{s.error}; {errors[0]}"
        return s


class PullPair(Pair):
    name = "pull"

    def _launch(self) -> list[Proc]:
        return self._launch_in_tree("NixlConnector", free_port())

    def send(self, prompt: list[int], max_tokens: int, timeout: float) -> Sample:
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        start = time.perf_counter()
        try:
            params = _prefill_leg(self.p.url, self.model, prompt, headers, timeout)
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            return Sample(False, total_s=time.perf_counter() - start, error=f"prefill: {e!r}")
        gap = time.perf_counter() - start
        s = _stream(
            self.d.url,
            self.model,
            prompt,
            max_tokens,
            timeout,
            headers,
            {"kv_transfer_params": params},
        )
        s.ttft_s = gap + s.ttft_s if s.ok else 0.0
        s.second_s = gap + s.second_s if s.second_s else 0.0
        s.total_s += gap
        return s


def _prefill_leg(
    url: str, model: str, prompt: list[int], headers: dict[str, str], timeout: float
) -> dict[str, Any]:
    """Pull's first leg: one token, no stream; returns the kv_transfer_params P hands back."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
    params = data["kv_transfer_params"]
    if not isinstance(params, dict):
        raise ValueError(f"prefiller returned kv_transfer_params={params!r}")
    return params


def variant_trees(values: list[str], error: Callable[[str], Any]) -> dict[str, str]:
    """``--variant LABEL=DIR`` values as label -> absolute source tree; `error` (an
    argparse parser's) for one that is not of that form."""
    trees = {}
    for v in values:
        label, sep, tree = v.partition("=")
        if not (sep and label and tree):
            error(f"--variant {v!r}: expected LABEL=DIR")
        trees[label] = str(Path(tree).resolve())
    return trees


def variant_env(tree: str) -> dict[str, str]:
    """The environment that makes a pair's servers and router import kvpush from `tree`
    (its ``spec["env"]``)."""
    path = os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "PYTHONSAFEPATH": "1"}  # else `python -m` puts the cwd first


def make_pair(name: str, model: str, log_dir: str, **spec: Any) -> Pair:
    """A pair by configuration name; ``spec``: further ServerSpec fields for its servers.
    ``kvpush@LABEL`` is a kvpush pair too (an A/B variant: the caller points its servers'
    PYTHONPATH at another source tree through ``spec["env"]``)."""
    if name.startswith("kvpush@"):
        pair = KvpushPair(model, log_dir, **spec)
        pair.name = name
        return pair
    kinds: dict[str, type[Pair]] = {
        "plain": PlainPair,
        "plain-nocache": PlainNoCachePair,
        "kvpush": KvpushPair,
        "push": InTreePushPair,
        "pull": PullPair,
    }
    if name not in kinds:
        raise ValueError(f"unknown configuration {name!r}; known: {', '.join(kinds)}")
    return kinds[name](model, log_dir, **spec)


def start_pairs(pairs: dict[str, Pair], timeout: float = 420) -> dict[str, Pair]:
    """Start every pair at once (each waits for its own health); if any fails, stop them
    all and raise with each failure's tail."""
    errors: dict[str, str] = {}

    def up(name: str) -> None:
        try:
            pairs[name].start(timeout=timeout)
        except Exception as e:  # reported below, after every pair was stopped
            errors[name] = str(e)[-2000:]

    threads = [threading.Thread(target=up, args=(n,)) for n in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in pairs.values():
            p.stop()
        raise RuntimeError(f"contenders failed to start: {errors}")
    return pairs
