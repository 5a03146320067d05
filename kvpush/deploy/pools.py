"""Pools of kvpush prefillers and decoders with the router in front (tests, demos)."""

from __future__ import annotations

from typing import Any

from kvpush.deploy.servers import (
    RouterProc,
    ServerSpec,
    VllmServer,
    free_port,
    kvpush_config,
    wait_healthy,
)


class PoolCluster:
    """`n_prefill` prefillers and `n_decode` decoders (CPU cores alternating), and
    `kvpush router` over all of them; a context manager that always cleans up."""

    def __init__(
        self,
        model: str,
        log_dir: str,
        n_prefill: int = 2,
        n_decode: int = 2,
        router_args: list[str] | None = None,
        max_model_len: int = 512,
        **extra: Any,
    ) -> None:
        self.side_ports = [free_port() for _ in range(n_prefill)]
        self.ps = [
            VllmServer(
                ServerSpec(
                    f"prefill{i}",
                    model,
                    kv_config=kvpush_config("kv_producer", f"prefill{i}", port, **extra),
                    core=i % 2,
                    max_model_len=max_model_len,
                    log_dir=log_dir,
                )
            )
            for i, port in enumerate(self.side_ports)
        ]
        self.ds = [
            VllmServer(
                ServerSpec(
                    f"decode{i}",
                    model,
                    kv_config=kvpush_config("kv_consumer", f"decode{i}", free_port(), **extra),
                    core=(i + 1) % 2,
                    max_model_len=max_model_len,
                    log_dir=log_dir,
                )
            )
            for i in range(n_decode)
        ]
        self.router = RouterProc(
            [p.url for p in self.ps],
            [d.url for d in self.ds],
            [f"127.0.0.1:{port}" for port in self.side_ports],
            log_dir,
            extra=router_args,
        )

    def servers(self) -> list[VllmServer]:
        return [*self.ps, *self.ds]

    def __enter__(self) -> PoolCluster:
        try:
            wait_healthy([*self.servers(), self.router])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in (self.router, *self.ds, *self.ps):
            proc.stop()
