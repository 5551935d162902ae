"""``RaydirectConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on
raydirect's regions, for disaggregated prefill and decode.

Turn it on with ``kv_transfer_config={"kv_connector": "RaydirectConnector",
"kv_role": "kv_both"}`` on both engines: the ``vllm.general_plugins`` entry point
registers the name. The protocol is vLLM's standard one (NixlConnector's), so
its proxies and routers drive it unchanged:

1. The prefill engine (P) gets a request with ``kv_transfer_params =
   {"do_remote_decode": True}`` (and ``max_tokens=1``). Its workers exported
   their paged KV caches as one region each at start. When the request finishes,
   ``request_finished`` keeps its blocks (vLLM frees them later) and returns
   ``kv_transfer_params``: the block ids, one region handle per TP rank, the
   caches' layout and the lease's end (``kv_handoff``).
2. The decode engine (D) gets the prompt with those params. Its scheduler
   counts what its own prefix cache lacks; its workers read exactly those blocks
   straight into the blocks vLLM just allocated, in the background, then notify
   P's worker, which frees them at its next step. A read that fails reports the
   blocks as load errors: vLLM fails the request (``kv_load_failure_policy``
   ``"fail"``, vLLM 0.32's default) or recomputes them (``"recompute"``).
3. P frees blocks nobody read when the lease ends: ``kv_lease_duration`` seconds
   in ``kv_connector_extra_config`` (30 by default, as NixlConnector's). D reads
   only while the lease has more than ``READ_MARGIN_S`` left, and a hand-off
   once (a second request here with the same params prefills itself), so it
   never reads blocks P has freed on the lease's end or a read's notice.

This module is the facade; ``kv_scheduler`` the scheduler side, ``kv_worker`` the workers'.
See docs/kv-transfer.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from raydirect.vllm.versions import needed_by

with needed_by("raydirect's KV connector"):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from raydirect.vllm import kv_worker
    from raydirect.vllm.kv_handoff import KVMetadata
    from raydirect.vllm.kv_scheduler import (
        DEFAULT_LEASE_S,
        KVScheduler,
        extra_config,
        fingerprint,
        schedulers,
    )

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["DEFAULT_LEASE_S", "KVScheduler", "RaydirectConnector", "status"]


def status() -> list[dict[str, Any]]:
    """What this process's schedulers hold (tests, debugging): their engine core
    process's, or the engine's own where vLLM runs it in process."""
    return [s.status() for s in schedulers]


class RaydirectConnector(KVConnectorBase_V1):
    """vLLM's KV connector over raydirect regions (module docstring). One object
    per process role: the scheduler's, and one per worker."""

    _cache_hit_source = CacheHitSource.P2P

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False (vLLM 0.33 asks, and refuses ``enable_sleep_mode`` then): a sleep
        remaps the KV caches, and the region exported at ``register_kv_caches``
        would name memory the engine no longer uses. Regions are not re-exported
        on wake yet."""
        return False

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = vllm_config
        self._scheduler: KVScheduler | None = None
        self._worker: kv_worker.KVWorker | None = None
        assert vllm_config.kv_transfer_config is not None
        _, huge_pages = extra_config(vllm_config.kv_transfer_config)  # refused in each role
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVScheduler(vllm_config)
        else:
            self._worker = kv_worker.KVWorker(
                kv_cache_config.num_blocks,
                get_tensor_model_parallel_rank(),
                vllm_config.parallel_config.tensor_parallel_size,
                huge_pages=huge_pages,
            )

    @property
    def scheduler(self) -> KVScheduler:
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    @property
    def worker(self) -> kv_worker.KVWorker:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # -- worker side --------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches, fingerprint(self._config))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMetadata)
        self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Reads land whole, before the request is scheduled: nothing per layer."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing to save: decode engines read the prefill engine's own blocks."""

    def wait_for_save(self) -> None:
        """Nothing to save (``save_kv_layer``)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self.worker.results()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler in schedulers:
            schedulers.remove(self._scheduler)

    # -- scheduler side -----------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.set_handshakes(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.sent(connector_output)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_meta()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, block_ids)
