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

This module is the facade and the scheduler side; ``kv_worker`` the workers'.
See docs/kv-transfer.md.
"""

from __future__ import annotations

import logging
import time
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
    from vllm.v1.request import RequestStatus

    from raydirect.vllm import kv_worker
    from raydirect.vllm.kv_handoff import (
        READ_MARGIN_S,
        Handoff,
        Handshake,
        KVMetadata,
        Read,
        handoff_params,
    )

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


class KVScheduler:
    """The scheduler side (module docstring): which requests to read, and which
    blocks to hold for whom."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.engine_id = str(transfer.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        lease = transfer.get_from_extra_config("kv_lease_duration", DEFAULT_LEASE_S)
        self.lease_s = _lease_s(lease)
        self.handshakes: list[Handshake] = []
        self._reads: dict[str, Read] = {}
        self._leases: dict[str, float] = {}
        # P's request id -> (the request here that read it, the lease's end)
        self._claims: dict[str, tuple[str, float]] = {}

    def set_handshakes(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        ranks = sorted(metadata)
        if ranks != list(range(self.tp_size)):
            raise RuntimeError(f"RaydirectConnector: handshakes from ranks {ranks}")
        shakes = [h for h in (metadata[r] for r in ranks) if isinstance(h, Handshake)]
        if len(shakes) != len(ranks):
            raise TypeError("RaydirectConnector: a worker sent another connector's handshake")
        if any(h.layout != shakes[0].layout for h in shakes):
            raise RuntimeError("RaydirectConnector: TP ranks lay out their KV caches differently")
        self.handshakes = shakes

    # -- decode side --------------------------------------------------------

    def _handoff(self, request: Request) -> tuple[Handoff | None, bool]:
        """The request's hand-off (None: not one of ours) and whether this engine
        can read it (logged if not: it prefills the prompt itself)."""
        params = request.kv_transfer_params or {}
        try:
            handoff = Handoff.of(params)
        except ValueError as exc:
            logger.warning("RaydirectConnector: request %s: %s", request.request_id, exc)
            return None, False
        problem = None
        if len(handoff.regions) != self.tp_size:
            problem = f"its prefill engine has TP {len(handoff.regions)}, this one {self.tp_size}"
        elif handoff.block_size != self.block_size:
            problem = f"block size {handoff.block_size} there, {self.block_size} here"
        if problem is not None:
            logger.warning(
                "RaydirectConnector: request %s is prefilled here (%s)", request.request_id, problem
            )
        return handoff, problem is None

    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        handoff, usable = self._handoff(request)
        if handoff is None or not usable:
            return 0, False  # prefilled here; update_state_after_alloc frees P's blocks
        if handoff.seconds_left() <= 0:
            logger.warning(
                "RaydirectConnector: request %s is prefilled here: the prefill engine's lease "
                "of its KV ended %.1fs before this engine could read it (raise "
                "kv_lease_duration on the prefill engine if decodes start that late)",
                request.request_id,
                -handoff.seconds_left(),
            )
            return 0, False
        claim = self._claims.get(handoff.remote_request_id)
        if claim is not None and claim[0] != request.request_id:
            logger.warning(
                "RaydirectConnector: request %s is prefilled here: request %s read the same "
                "hand-off (prefill request %s) already, and the prefill engine frees its "
                "blocks on the first read. A hand-off is read once: send its "
                "kv_transfer_params to one decode request",
                request.request_id,
                claim[0],
                handoff.remote_request_id,
            )
            return 0, False
        remote = min(handoff.num_tokens, request.num_prompt_tokens)
        count = remote - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one read per request
        handoff, usable = self._handoff(request)
        if handoff is None or not self._claim(handoff, request.request_id):
            return  # another request here read it: P was told to free the blocks then
        local = blocks.get_unhashed_block_ids() if num_external > 0 and usable else []
        # By position: D's prefix-cache blocks come first, then the ones to read
        # (P's generated tokens, if any, lie in blocks after the prompt's).
        ahead = len(blocks.get_block_ids()[0]) - len(local)
        remote = list(handoff.block_ids[ahead : ahead + len(local)])
        needed = -(-(ahead * self.block_size + num_external) // self.block_size) - ahead
        error = None
        if len(remote) < needed:
            error = f"the prefill engine handed over {len(handoff.block_ids)} blocks, too few"
        self._reads[request.request_id] = Read(
            request.request_id,
            local[: len(remote)],
            remote,
            handoff,
            awaiting=num_external > 0,
            error=error,
        )

    def _claim(self, handoff: Handoff, request_id: str) -> bool:
        """Whether ``request_id`` reads ``handoff`` here: the first request that
        comes with it does. A second (a client's retry, a duplicate) would read
        blocks P freed on the first one's notice and may have reused."""
        now = time.time()
        while self._claims:  # oldest first; past its lease nobody reads it anyway
            oldest = next(iter(self._claims))
            if self._claims[oldest][1] >= now:
                break
            del self._claims[oldest]
        claim = self._claims.setdefault(handoff.remote_request_id, (request_id, handoff.expires_at))
        return claim[0] == request_id

    # -- prefill side -------------------------------------------------------

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # aborted before it read: free P's blocks
            params["do_remote_prefill"] = False
            handoff, _ = self._handoff(request)
            if handoff is not None:
                self._reads[request.request_id] = Read(request.request_id, [], [], handoff, False)
            return False, None
        if not params.get("do_remote_decode") or not block_ids or not self.handshakes:
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted: nobody reads it
        # The prompt's blocks alone: a prefill that generated more than its first
        # token holds those tokens' KV in later blocks, which no decode engine needs.
        prompt = min(request.num_computed_tokens, request.num_prompt_tokens)
        expires_at = time.time() + self.lease_s
        self._leases[request.request_id] = expires_at
        return True, handoff_params(
            request_id=request.request_id,
            engine_id=self.engine_id,
            block_ids=list(block_ids[: -(-prompt // self.block_size)]),
            num_tokens=prompt,
            handshakes=self.handshakes,
            block_size=self.block_size,
            expires_at=expires_at,
        )

    # -- every step ---------------------------------------------------------

    def build_meta(self) -> KVMetadata:
        meta = KVMetadata(reads=list(self._reads.values()), leases=self._leases)
        self._reads, self._leases = {}, {}
        return meta


def _lease_s(value: Any) -> float:
    """``kv_lease_duration``, checked: a lease no longer than the read margin would
    end before any decode engine may read, and hand-off would silently stop."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= READ_MARGIN_S:
        raise ValueError(
            f"RaydirectConnector: kv_connector_extra_config's kv_lease_duration={value!r}: "
            f"write a number of seconds above {READ_MARGIN_S} (a decode engine reads only "
            f"while more than {READ_MARGIN_S}s of it is left; {DEFAULT_LEASE_S:g} by default, "
            "as NixlConnector's)"
        )
    return float(value)


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
        self._scheduler: KVScheduler | None = None
        self._worker: kv_worker.KVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVScheduler(vllm_config)
        else:
            self._worker = kv_worker.KVWorker(
                kv_cache_config.num_blocks,
                get_tensor_model_parallel_rank(),
                vllm_config.parallel_config.tensor_parallel_size,
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
        self.worker.register(kv_caches)

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

    # -- scheduler side -----------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.set_handshakes(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

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
