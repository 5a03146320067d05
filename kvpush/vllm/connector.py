"""``KVPushConnector``: vLLM's v1 KV-connector interface over the kvpush core.

Load it with ``--kv-transfer-config '{"kv_connector": "KVPushConnector",
"kv_connector_module_path": "kvpush.vllm", "kv_role": "kv_producer" | "kv_consumer",
"engine_id": "...", "kv_connector_extra_config": {...}}'``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvpush.core.types import StepMeta
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.scheduler_side import SchedulerSide
from kvpush.vllm.stats import KVPushPromMetrics, KVPushStats
from kvpush.vllm.worker_side import WorkerSide

try:  # vLLM 0.32; absent in some other versions
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


@dataclass
class KVPushMeta(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> workers, once per step (pickled)."""

    step: StepMeta = field(default_factory=StepMeta)
    idle: bool = False  # the step schedules no tokens (vLLM steps only to let us poll)


@dataclass
class KVPushWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers -> scheduler, once per step: what finished_* cannot say."""

    failed: dict[str, str] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    renewed: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPushWorkerMeta:
        assert isinstance(other, KVPushWorkerMeta)
        return KVPushWorkerMeta(
            {**self.failed, **other.failed},
            self.released | other.released,
            self.renewed | other.renewed,
            self.held | other.held,
        )


class KVPushConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # the base class refuses a config without it
        self.opts = ConnectorOptions.parse(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.sched_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.sched_side = SchedulerSide(
                self.engine_id,
                self.opts,
                bool(ktc.is_kv_producer),
                bool(ktc.is_kv_consumer),
                tp_size,
                int(vllm_config.parallel_config.pipeline_parallel_size),
                self.block_size,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker_side = WorkerSide(
                self.engine_id,
                self.opts,
                get_tensor_model_parallel_rank(),
                tp_size,
                bool(ktc.is_kv_producer),
            )
        self._kv_cache_config = kv_cache_config

    # ---- worker role -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker_side is not None
        num_blocks = (
            int(getattr(self._kv_cache_config, "num_blocks", 0))
            or next(iter(kv_caches.values())).shape[0]
        )
        mla = bool(getattr(self._vllm_config.model_config, "use_mla", False))
        self.worker_side.register(kv_caches, num_blocks, self.block_size, mla)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:  # a step begins (start_load_kv may follow its forward)
            self.worker_side.step_began()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KVPushMeta):
            self.worker_side.start_step(meta.step, idle=meta.idle)
        else:
            self.worker_side.start_step(None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # KV arrives whole before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # vLLM calls this once the layer's attention wrote its KV: the prompts pushed layer
        # by layer note it (their WRITEs are posted by the next tick, not here).
        assert self.worker_side is not None
        if self.worker_side.layers.current:
            self.worker_side.layers.saved(layer_name)

    def wait_for_save(self) -> None:
        assert self.worker_side is not None
        self.worker_side.hand_over()  # the prefills this forward completes

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        assert self.worker_side is not None
        rep = self.worker_side.collect()
        return KVConnectorTransferResults(
            finished_sending=rep.finished_sending,
            finished_recving=rep.finished_recving,
            failed_recving=set(rep.failed),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Asked after get_transfer_results each step: a held receive's blocks come here
        # first, its id as finished once no late WRITE can land (core/late_writes.py).
        assert self.worker_side is not None
        return self.worker_side.take_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def build_connector_worker_meta(self) -> KVPushWorkerMeta | None:
        assert self.worker_side is not None
        meta = self.worker_side.take_meta()
        if meta is None:
            return None
        return KVPushWorkerMeta(meta.failed, meta.released, meta.renewed, meta.held)

    def get_kv_connector_stats(self) -> KVPushStats | None:
        if self.worker_side is None:
            return None
        delta = self.worker_side.stats_delta()
        return KVPushStats(data=delta) if delta else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # ---- scheduler role --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self.sched_side is not None
        return self.sched_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched_side is not None
        groups = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self.sched_side.update_state_after_alloc(
            request, groups, num_external_tokens, self.block_size
        )

    def on_new_request(self, request: Any) -> None:
        if self.sched_side is not None:
            self.sched_side.on_new_request(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVPushMeta:
        assert self.sched_side is not None
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
        meta = KVPushMeta(step=self.sched_side.build_meta(scheduler_output), idle=idle)
        if meta.step.layered:
            # vLLM 0.32 calls start_load_kv after the forward unless a step has sync loads;
            # the feeds of prompts pushed layer by layer must be open before it.
            scheduler_output.has_sync_kv_loads = True
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.sched_side is not None
        self.sched_side.update(
            connector_output.finished_sending or set(),
            connector_output.finished_recving or set(),
            getattr(connector_output, "kv_connector_worker_meta", None),
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched_side is not None
        return self.sched_side.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.sched_side is not None and self.sched_side.sched.has_pending_push_work()

    # ---- stats -----------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPushStats:
        return KVPushStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> KVPushPromMetrics:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
