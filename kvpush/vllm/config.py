"""kvpush's options for vLLM, read from kv_connector_extra_config and the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.lane import MAX_SLOTS
from kvpush.core.secret import Secret

ENV_HOST = "KVPUSH_SIDE_CHANNEL_HOST"
ENV_PORT = "KVPUSH_SIDE_CHANNEL_PORT"
ENV_SECRET = "KVPUSH_SHARED_SECRET"  # from the environment only: configs end up in logs
# vLLM's NIXL connectors' names for the same, read when kvpush's are not set: a server
# moved from NixlPushConnector keeps its environment (docs/migration.md).
ENV_NIXL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_NIXL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"


@dataclass(frozen=True)
class ConnectorOptions:
    """Everything the connector takes from ``kv_connector_extra_config``.

    ``side_channel_port`` is rank 0's handshake port; TP rank r listens on port + r.
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    lease_s: float = 30.0
    watchdog_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    handshake_timeout_s: float = 5.0
    registration_ttl_s: float = 60.0
    unknown_request_grace_s: float = 5.0  # P: refuse a registration naming no request by then
    peer_copy: str = "auto"  # CUDA IPC copy into same-host decoders: auto (CUDA+CuPy), on, off
    # Words of the completion lane a decoder offers same-host copies (0: completions over
    # NIXL only); see kvpush/core/lane.py.
    lane_slots: int = 1 << 16
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

    @property
    def trusted(self) -> frozenset[str] | None:
        names = [x.strip() for x in self.trusted_decoders.split(",") if x.strip()]
        return frozenset(names) if names else None

    @property
    def trusted_p(self) -> frozenset[str] | None:
        names = [x.strip() for x in self.trusted_prefillers.split(",") if x.strip()]
        return frozenset(names) if names else None

    @property
    def hold_s(self) -> float | None:
        return None if self.late_write_hold_s == "auto" else float(self.late_write_hold_s)

    @property
    def secret(self) -> Secret | None:
        return self.shared_secret

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
        known = {f.name: f for f in fields(cls) if f.name != "shared_secret"}
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
        for key, value in values.items():
            kind = type(getattr(cls, key))
            try:
                out[key] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"kvpush option {key}={value!r} is not a {kind.__name__}"
                ) from None
        opts = cls(**out)
        if not 0 < opts.side_channel_port < 65536:
            raise ConfigError(f"side_channel_port {opts.side_channel_port} out of range")
        for name in (
            "lease_s",
            "watchdog_s",
            "heartbeat_interval_s",
            "handshake_timeout_s",
            "registration_ttl_s",
            "unknown_request_grace_s",
        ):
            if not getattr(opts, name) > 0:
                raise ConfigError(f"kvpush option {name} must be > 0")
        for name, entries in (
            ("trusted_decoders", opts.trusted),
            ("trusted_prefillers", opts.trusted_p),
        ):
            for where in entries or ():
                host, _, port = where.rpartition(":")
                if not host or not port.isdigit():
                    raise ConfigError(f"{name} entry {where!r} is not host:port")
        if opts.peer_copy not in ("auto", "on", "off"):
            raise ConfigError("peer_copy must be 'auto', 'on' or 'off'")
        if opts.late_write_hold_s != "auto":
            try:
                hold = float(opts.late_write_hold_s)
            except ValueError:
                hold = -1.0
            if not hold >= 0:
                raise ConfigError("late_write_hold_s must be 'auto' or seconds >= 0")
        if opts.layerwise_min_tokens < 0:
            raise ConfigError("layerwise_min_tokens must be >= 0")
        if not 0 <= opts.lane_slots <= MAX_SLOTS:
            raise ConfigError(f"lane_slots must be in [0, {MAX_SLOTS}]")
        return opts
