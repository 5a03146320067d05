"""Start and stop vLLM servers and the router as subprocesses (demo, tests, benchmarks).

Nothing here imports vLLM: servers run ``python -m vllm.entrypoints.openai.api_server``
in the same interpreter environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEALTH_TIMEOUT_S = 240.0
ENV_DEVICE = "KVPUSH_DEVICE"  # "cpu" or "cuda": which vLLM build the servers run


def default_device() -> str:
    """``$KVPUSH_DEVICE``, else ``cuda`` where an NVIDIA driver is installed, else ``cpu``."""
    dev = os.environ.get(ENV_DEVICE, "")
    if dev:
        if dev not in ("cpu", "cuda"):
            raise ValueError(f"{ENV_DEVICE}={dev!r}: expected 'cpu' or 'cuda'")
        return dev
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


# Ports handed out by this process. A port is free until its server binds it, so two calls
# made before then could return the same one (seen: a decoder's side channel took the port
# its HTTP server was handed next, and the server never came up); none is handed out twice.
_handed: set[int] = set()
_handed_lock = threading.Lock()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768+), so that a port vLLM (or
    its ZMQ) picks for itself later cannot collide with the one we hand out now; never one
    this process handed out before."""
    return free_ports(1)


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (TP/PP ranks listen on base + rank)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randint(20000, 32000 - n)
        with _handed_lock:
            wanted = set(range(base, base + n))
            if wanted & _handed or not _bindable(wanted):
                continue
            _handed.update(wanted)
            return base
    raise RuntimeError(f"no {n} free consecutive ports in 20000-32000")


def _bindable(ports: set[int]) -> bool:
    socks = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


def kvpush_config(role: str, engine_id: str, side_port: int, **extra: Any) -> dict[str, Any]:
    """A --kv-transfer-config for kvpush's connector (role: kv_producer or kv_consumer)."""
    return {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.vllm",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {"side_channel_port": side_port, **extra},
    }


@dataclass
class ServerSpec:
    name: str
    model: str
    port: int = 0
    kv_config: dict[str, Any] | None = None
    core: int = 0  # the CPU core vLLM's OpenMP threads are bound to
    env: dict[str, str] = field(default_factory=dict)
    max_model_len: int = 512
    max_num_seqs: int = 4
    log_dir: str = "."
    device: str = ""  # "cpu" or "cuda"; empty: default_device()
    # GPU only. Several servers share one GPU: each takes this share at start-up (vLLM
    # checks it against free memory), and kv_cache_bytes, when set, fixes its KV cache
    # instead of profiling (servers started at once would see each other's memory).
    gpu_memory_utilization: float = 0.1
    kv_cache_bytes: int = 0
    max_num_batched_tokens: int = 0  # 0: vLLM's default
    # Eager (no CUDA graphs, no torch.compile): the CPU build needs it; on GPUs the
    # benchmark can turn CUDA graphs on (cuda_graphs) for every server alike.
    cuda_graphs: bool = False
    host: str = "127.0.0.1"  # the address the HTTP server listens on
    # A command the server runs under, e.g. one that enters a test host's network
    # namespace (tests/e2e/hosts.py); empty: run it directly.
    prefix: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)  # further vLLM server flags

    def __post_init__(self) -> None:
        self.device = self.device or default_device()

    def args(self) -> list[str]:
        """vLLM server flags for this spec's device."""
        out = ["--dtype", "float32" if self.device == "cpu" else "bfloat16"]
        if self.device == "cuda":
            out += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
            if self.kv_cache_bytes:
                out += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.device == "cuda" and self.cuda_graphs:
            # Full-graph decode steps without torch.compile (no compiler needed).
            cc = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 32}
            out += ["--compilation-config", json.dumps(cc)]
        else:
            out.append("--enforce-eager")
        if self.max_num_batched_tokens:
            out += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return out

    def environ(self) -> dict[str, str]:
        """The server's environment: ours, with the device's settings and the spec's own."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
        return {**env, **self.env}


class Proc:
    """A subprocess in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(
            argv,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            self._signal(signal.SIGCONT)  # a paused process handles nothing else
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.popen.wait(10)
        self._log.close()

    def kill(self) -> None:
        if self.alive():
            self._signal(signal.SIGKILL)
            self.popen.wait(10)

    def send(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (the server and its children)."""
        self._signal(sig)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class VllmServer(Proc):
    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        if not spec.port:
            spec.port = free_port()
        argv = [
            *spec.prefix,
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            spec.model,
            *spec.args(),
            "--max-model-len",
            str(spec.max_model_len),
            "--max-num-seqs",
            str(spec.max_num_seqs),
            "--host",
            spec.host,
            "--port",
            str(spec.port),
        ]
        if spec.kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(spec.kv_config)]
        argv += spec.extra_args
        env = spec.environ()
        log_dir = Path(spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(spec.name, argv, env, log_dir / f"{spec.name}.log")

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"


class RouterProc(Proc):
    """`kvpush router` as a subprocess; `prefill`, `decode` and `side_channel` may each be
    one value or a list (pools; side channels pair with prefill URLs in order)."""

    def __init__(
        self,
        prefill: str | list[str],
        decode: str | list[str],
        side_channel: str | list[str],
        log_dir: str,
        port: int = 0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        argv = [sys.executable, "-m", "kvpush.cli", "router", "--port", str(self.port)]
        for flag, values in (
            ("--prefill", prefill),
            ("--decode", decode),
            ("--prefill-side-channel", side_channel),
        ):
            for value in [values] if isinstance(values, str) else values:
                argv += [flag, value]
        argv += extra or []
        env = {**os.environ, **(env or {})}
        super().__init__("router", argv, env, Path(log_dir) / "router.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def wait_healthy(procs: list[Any], timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Poll each process's /health until 200; raise with its log tail if it dies or times out."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{p.tail()}")
            try:
                with urllib.request.urlopen(p.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(p)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not healthy after {timeout:.0f}s:\n{pending[0].tail()}")
        if pending:
            time.sleep(0.5)


def metrics_text(url: str, timeout: float = 10.0) -> str:
    """``url``/metrics, the Prometheus text format."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return str(r.read().decode())


def metric_in(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """Sum of a Prometheus metric's samples in ``text`` (optionally filtered by labels);
    None when it has none."""
    total = None
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        total = (total or 0.0) + float(value)
    return total


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus metric's samples (optionally filtered by labels) at ``url``/metrics."""
    return metric_in(metrics_text(url), name, labels) or 0.0


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block, as Ctrl-C would, so the
    finally-blocks of whatever started servers stop them; the old handler comes back."""

    def _raise(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
