"""kvpush's options for vLLM, read from kv_connector_extra_config and the environment.

One schema: each key is a field of ``ConnectorOptions``; a key the core takes gets its
default from, and is checked by, the core's own config (``WorkerConfig``, one worker;
``SchedulerConfig``, leases and watchdogs), so no rule is written twice. Only the keys the
core does not take are checked here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from kvpush.core import seal
from kvpush.core.errors import ConfigError
from kvpush.core.scheduler import SchedulerConfig
from kvpush.core.secret import Secret
from kvpush.core.types import WorkerConfig, addresses

ENV_HOST = "KVPUSH_SIDE_CHANNEL_HOST"
ENV_PORT = "KVPUSH_SIDE_CHANNEL_PORT"
ENV_SECRET = "KVPUSH_SHARED_SECRET"  # from the environment only: configs end up in logs
# vLLM's NIXL connectors' names for the same, read when kvpush's are not set: a server
# moved from NixlPushConnector keeps its environment (docs/migration.md).
ENV_NIXL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_NIXL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"

# The core's defaults, so that they are written once.
_W: dict[str, Any] = {f.name: f.default for f in fields(WorkerConfig)}
_S: dict[str, Any] = {f.name: f.default for f in fields(SchedulerConfig)}


@dataclass(frozen=True)
class ConnectorOptions:
    """Everything the connector takes from ``kv_connector_extra_config``.

    ``side_channel_port`` is rank 0's handshake port; TP rank r listens on port + r.
    """

    side_channel_host: str = _W["host"]
    side_channel_port: int = _W["port"]
    lease_s: float = _S["lease_s"]
    watchdog_s: float = _S["watchdog_s"]
    heartbeat_interval_s: float = _W["heartbeat_interval_s"]
    handshake_timeout_s: float = _W["handshake_timeout_s"]
    registration_ttl_s: float = _W["registration_ttl_s"]
    unknown_request_grace_s: float = _W["unknown_request_grace_s"]
    peer_copy: str = "auto"  # CUDA IPC copy into same-host decoders: auto (CUDA+CuPy), on, off
    lane_slots: int = _W["lane_slots"]
    # Push a one-token prefill layer by layer while its forward runs when its prompt has
    # at least this many tokens (0: never); only without the peer-copy hook.
    layerwise_min_tokens: int = 0
    trusted_decoders: str = ""  # "host:port,host:port" of decoder side channels; empty: any
    # D: the prefiller side channels (rank 0's "host:port") a request's kv_transfer_params
    # may name; empty: any (then D handshakes with whatever address a request names).
    trusted_prefillers: str = ""
    # Seconds D keeps the blocks of a receive its watchdog failed while P could still be
    # writing (kvpush/core/late_writes.py); "auto": the kernel's TCP give-up time.
    late_write_hold_s: str = "auto"
    # From KVPUSH_SHARED_SECRET only; a Secret, so no repr (vLLM prints this) shows it.
    shared_secret: Secret | None = field(default=None, repr=False, compare=False)
    # From KVPUSH_PARAMS_SECRET only: act on a request's kv_transfer_params only when the
    # router sealed them with it (kvpush.core.seal).
    params_secret: Secret | None = field(default=None, repr=False, compare=False)

    # Parsed once: the scheduler side reads trusted_p for every request.
    @cached_property
    def trusted(self) -> frozenset[str] | None:
        return addresses("trusted_decoders", self.trusted_decoders)

    @cached_property
    def trusted_p(self) -> frozenset[str] | None:
        return addresses("trusted_prefillers", self.trusted_prefillers)

    @property
    def hold_s(self) -> float | None:
        if self.late_write_hold_s == "auto":
            return None
        try:
            return float(self.late_write_hold_s)
        except ValueError:
            raise ConfigError("late_write_hold_s must be 'auto' or seconds >= 0") from None

    @property
    def secret(self) -> Secret | None:
        return self.shared_secret

    def worker_config(
        self, engine_id: str, tp_rank: int = 0, tp_size: int = 1, prefiller: bool = True
    ) -> WorkerConfig:
        """One rank's worker config (raises ConfigError for a value out of range)."""
        return WorkerConfig(
            prefiller=prefiller,
            engine_id=engine_id,
            host=self.side_channel_host,
            port=self.side_channel_port + tp_rank,
            tp_rank=tp_rank,
            tp_size=tp_size,
            heartbeat_interval_s=self.heartbeat_interval_s,
            handshake_timeout_s=self.handshake_timeout_s,
            registration_ttl_s=self.registration_ttl_s,
            unknown_request_grace_s=self.unknown_request_grace_s,
            lane_slots=self.lane_slots,
            trusted_decoders=self.trusted,
            shared_secret=self.secret,
            late_write_hold_s=self.hold_s,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.lease_s, self.watchdog_s)

    @classmethod
    def parse(
        cls, extra: dict[str, Any] | None, env: dict[str, str] | None = None
    ) -> ConnectorOptions:
        """Validate ``extra`` (unknown keys and wrong types are errors) over env defaults."""
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for key, names in (
            ("side_channel_host", (ENV_HOST, ENV_NIXL_HOST)),
            ("side_channel_port", (ENV_PORT, ENV_NIXL_PORT)),
        ):
            found = [env[name] for name in names if name in env]
            if found:
                values[key] = found[0]
        known = {f.name: f for f in fields(cls) if not f.name.endswith("_secret")}
        for key, value in (extra or {}).items():
            if key not in known:
                raise ConfigError(
                    f"unknown kvpush option {key!r} in kv_connector_extra_config; "
                    f"known: {', '.join(sorted(known))}"
                )
            values[key] = ",".join(map(str, value)) if isinstance(value, list) else value
        out: dict[str, Any] = {}
        if env.get(ENV_SECRET):
            out["shared_secret"] = Secret(env[ENV_SECRET])
        out["params_secret"] = seal.from_env(env)
        for key, value in values.items():
            kind = type(getattr(cls, key))
            try:
                out[key] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"kvpush option {key}={value!r} is not a {kind.__name__}"
                ) from None
        opts = cls(**out)
        opts.check()
        return opts

    def check(self) -> None:
        """ConfigError for a value out of range: the core's configs check what they take."""
        self.worker_config("check")
        self.scheduler_config()
        self.trusted_p  # noqa: B018 (the property raises for an entry that is not host:port)
        if self.peer_copy not in ("auto", "on", "off"):
            raise ConfigError("peer_copy must be 'auto', 'on' or 'off'")
        if self.layerwise_min_tokens < 0:
            raise ConfigError("layerwise_min_tokens must be >= 0")
