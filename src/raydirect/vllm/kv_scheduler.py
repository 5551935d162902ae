"""The scheduler side of ``RaydirectConnector``: which requests to read, which
blocks to hold for whom, and the engine's settings and fingerprint. Runs in
vLLM's engine core process (no Ray connection: the signing key and the
workers' regions arrive in their handshakes). ``kv_connector`` is the facade;
``kv_worker`` the workers' side."""

from __future__ import annotations

import heapq
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.v1.request import RequestStatus

try:  # vLLM 0.32's helper (NixlConnector's); a vLLM without it fingerprints "unknown"
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
except ImportError:  # pragma: no cover
    get_current_attn_backends = None  # type: ignore[assignment,unused-ignore]

from raydirect.vllm.kv_handoff import (
    MAX_SEALS,
    READ_MARGIN_S,
    Handoff,
    Handshake,
    KVMetadata,
    Lease,
    Read,
    handoff_params,
    lease_seconds,
    seal_word,
    signing_key,
)
from raydirect.vllm.kv_layout import LayerRuns, layers_from_dict, mismatch
from raydirect.vllm.kv_params import MAX_LEASE_S, KVParamsError, flag

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
FINGERPRINT_VERSION = "raydirect-kv/2"  # bumped when what a hand-off means changes

schedulers: list[KVScheduler] = []  # this process's (kv_connector.status(), tests)


class KVScheduler:
    """The scheduler side (module docstring): which requests to read, and which
    blocks to hold for whom."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.engine_id = str(transfer.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.lease_s, _ = extra_config(transfer)
        self.handshakes: list[Handshake] = []
        self._key: bytes | None = None  # the cluster's signing key, from the handshakes
        self._fingerprint: tuple[tuple[str, str], ...] = ()
        self._layout: dict[str, LayerRuns] = {}  # this engine's own caches
        self._reads: dict[str, Read] = {}
        self._leases: dict[str, Lease] = {}
        # Prefill side: each request prefilled for a decode engine has a seal
        # (slot, secret) from its arrival to its lease's end; ``_arming``: the
        # seal words to set (0: clear) at the next step.
        self._free_slots = list(range(MAX_SEALS - 1, -1, -1))
        self._sealed: dict[str, tuple[int, str]] = {}
        self._arming: dict[str, tuple[int, int]] = {}
        self._out_of_seals = 0
        # Decode side: hand-offs whose requests wait here, and when their
        # leases were last renewed (monotonic; None: not yet).
        self._waiting: dict[str, tuple[Handoff, float | None]] = {}
        # P's request id -> (the request here that read it, the lease's end), and
        # the same ends in a heap: each claim goes when its own lease ends, so
        # state stays bounded whatever expiry one hand-off carries.
        self._claims: dict[str, tuple[str, float]] = {}
        self._claim_ends: list[tuple[float, str]] = []
        schedulers.append(self)

    def set_handshakes(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        ranks = sorted(metadata)
        if ranks != list(range(self.tp_size)):
            raise RuntimeError(f"RaydirectConnector: handshakes from ranks {ranks}")
        shakes = [h for h in (metadata[r] for r in ranks) if isinstance(h, Handshake)]
        if len(shakes) != len(ranks):
            raise TypeError("RaydirectConnector: a worker sent another connector's handshake")
        first = shakes[0]
        for field in ("layout", "fingerprint", "key"):
            if any(getattr(h, field) != getattr(first, field) for h in shakes):
                raise RuntimeError(
                    f"RaydirectConnector: the TP ranks' {field} differ (their KV caches, "
                    "their engine, or the Ray cluster they joined)"
                )
        self.handshakes = shakes
        self._layout = layers_from_dict(first.layout)
        self._key = signing_key(first.key)
        self._fingerprint = tuple(sorted(first.fingerprint.items()))

    def status(self) -> dict[str, Any]:
        """What the scheduler holds (tests, debugging)."""
        return {
            "claims": sorted(self._claims),
            "leases": sorted(self._leases),
            "sealed": len(self._sealed),
            "waiting": sorted(self._waiting),
            "out_of_seals": self._out_of_seals,
        }

    def on_new_request(self, request: Request) -> None:
        """Prefill side: a seal for a request to hand over, set before its prompt
        is computed. Decode side: its hand-off checked (one line if it cannot be
        read) and its lease renewed while it waits."""
        if _remote_prefill(request):
            handoff, usable = self._handoff(request)
            if handoff is not None and usable:
                self._waiting[request.request_id] = (handoff, None)
        elif _remote_decode(request):
            if not self._free_slots:
                self._out_of_seals += 1
                return  # not handed over (finished): its decode engine prefills it
            slot, secret = self._free_slots.pop(), secrets.token_hex(16)
            self._sealed[request.request_id] = (slot, secret)
            self._arming[request.request_id] = (slot, seal_word(secret))

    # -- decode side --------------------------------------------------------

    def _handoff(self, request: Request, quiet: bool = False) -> tuple[Handoff | None, bool]:
        """The request's hand-off (None: not one of ours, or malformed) and whether
        this engine can read it (logged if not: it prefills the prompt itself).
        Malformed params are logged once, naming the field, and the request
        then counts as one with nothing to read: every later hook passes it by."""
        params = _params(request)
        try:
            handoff = Handoff.of(params, self._key)
        except KVParamsError as exc:
            problem: str | None = f"its kv_transfer_params' {exc}"
        except Exception as exc:  # a check missed: still this request's, never the engine's
            logger.exception("RaydirectConnector: request %s's params", request.request_id)
            problem = f"its kv_transfer_params could not be read ({type(exc).__name__})"
        else:
            problem = self._unreadable(handoff)
            if problem is not None and not quiet:  # on_new_request said it
                logger.warning(
                    "RaydirectConnector: request %s is prefilled here (%s)",
                    request.request_id,
                    problem,
                )
            return handoff, problem is None
        params["do_remote_prefill"] = False
        logger.warning(
            "RaydirectConnector: request %s has nothing read for it (%s): computed here "
            "if it runs, and its prefill engine frees the blocks at its lease's end",
            request.request_id,
            problem,
        )
        return None, False

    def _unreadable(self, handoff: Handoff) -> str | None:
        """Why this engine cannot read ``handoff`` (another engine, TP, block
        size or layout), or None."""
        if handoff.fingerprint != self._fingerprint:
            theirs, ours = dict(handoff.fingerprint), dict(self._fingerprint)
            differ = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
            shown = "; ".join(f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ)
            return f"its prefill engine is not compatible with this one ({shown})"
        if len(handoff.regions) != self.tp_size:
            return f"its prefill engine has TP {len(handoff.regions)}, this one {self.tp_size}"
        if handoff.block_size != self.block_size:
            return f"block size {handoff.block_size} there, {self.block_size} here"
        return mismatch(handoff.layout, self._layout) if self._layout else None

    def _seconds_left(self, request: Request, handoff: Handoff) -> float:
        waiting = self._waiting.get(request.request_id)
        return handoff.seconds_left(waiting[1] if waiting is not None else None)

    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        if not _remote_prefill(request):
            return 0, False
        handoff, usable = self._handoff(request, quiet=True)
        if handoff is None or not usable:
            return 0, False  # prefilled here; update_state_after_alloc frees P's blocks
        left = self._seconds_left(request, handoff)
        if left <= 0:
            logger.warning(
                "RaydirectConnector: request %s is prefilled here: the prefill engine's lease "
                "of its KV ends too soon to read it (%.1fs left, %.1fs needed; raise "
                "kv_lease_duration on the prefill engine if decodes start that late)",
                request.request_id,
                left + READ_MARGIN_S,
                READ_MARGIN_S,
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
        if not _remote_prefill(request):
            return
        handoff, usable = self._handoff(request, quiet=True)
        _params(request)["do_remote_prefill"] = False  # one read per request
        if handoff is None:
            return
        left = self._seconds_left(request, handoff)
        self._waiting.pop(request.request_id, None)
        if not self._claim(handoff, request.request_id):
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
            seconds=left,
        )

    def _claim(self, handoff: Handoff, request_id: str) -> bool:
        """Whether ``request_id`` reads ``handoff`` here: the first request that
        comes with it does. A second (a client's retry, a duplicate) would read
        blocks P freed on the first one's notice and may have reused."""
        now = time.time()
        while self._claim_ends and self._claim_ends[0][0] < now:
            _, remote = heapq.heappop(self._claim_ends)  # past its lease nobody reads it
            self._claims.pop(remote, None)
        remote = handoff.remote_request_id
        if remote not in self._claims:
            # Renewals may hold it past its first expiry: kept as long as a lease may last.
            ends = max(handoff.expires_at, now + handoff.lease_s)
            self._claims[remote] = (request_id, ends)
            heapq.heappush(self._claim_ends, (ends, remote))
        return self._claims[remote][0] == request_id

    def _renewals(self) -> list[Handoff]:
        """The waiting hand-offs whose leases are due a renewal: at once, then
        every third of their length (two renewals may be lost before it ends)."""
        now, due = time.monotonic(), []
        for request, (handoff, renewed) in self._waiting.items():
            if renewed is None or now - renewed >= handoff.lease_s / 3:
                self._waiting[request] = (handoff, now)
                due.append(handoff)
        return due

    # -- prefill side -------------------------------------------------------

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._waiting.pop(request.request_id, None)
        if _remote_prefill(request):  # aborted (or rejected) before it read: free P's blocks
            handoff, _ = self._handoff(request, quiet=True)
            _params(request)["do_remote_prefill"] = False
            if handoff is not None:
                self._reads[request.request_id] = Read(request.request_id, [], [], handoff, False)
            return False, None
        seal = self._sealed.get(request.request_id)
        handed = (
            seal is not None
            and bool(block_ids)
            and bool(self.handshakes)
            and request.status
            in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        )
        if not handed:  # not one to hand over, or aborted: nobody reads it
            self._unseal(request.request_id)
            return False, None
        assert seal is not None
        # The prompt's blocks alone: a prefill that generated more than its first
        # token holds those tokens' KV in later blocks, which no decode engine needs.
        prompt = min(request.num_computed_tokens, request.num_prompt_tokens)
        self._leases[request.request_id] = Lease(self.lease_s, seal[0], seal_word(seal[1]))
        return True, handoff_params(
            request_id=request.request_id,
            engine_id=self.engine_id,
            block_ids=list(block_ids[: -(-prompt // self.block_size)]),
            num_tokens=prompt,
            handshakes=self.handshakes,
            block_size=self.block_size,
            expires_at=time.time() + self.lease_s,
            lease_s=self.lease_s,
            seal=seal,
        )

    def _unseal(self, request_id: str) -> None:
        """The request's seal cleared at the next step and its slot free again."""
        seal = self._sealed.pop(request_id, None)
        if seal is not None:
            self._arming.pop(request_id, None)
            self._arming[request_id] = (seal[0], 0)
            self._free_slots.append(seal[0])

    def sent(self, output: KVConnectorOutput) -> None:
        """Leases that ended (their workers cleared the seal words already)."""
        for request in output.finished_sending or ():
            seal = self._sealed.pop(request, None)
            if seal is not None:
                self._free_slots.append(seal[0])

    # -- every step ---------------------------------------------------------

    def build_meta(self) -> KVMetadata:
        meta = KVMetadata(
            reads=list(self._reads.values()),
            leases=self._leases,
            seals=self._arming,
            renewals=self._renewals(),
        )
        self._reads, self._leases, self._arming = {}, {}, {}
        return meta


def _params(request: Request) -> dict[str, Any]:
    """The request's ``kv_transfer_params``; {} where there are none (or, from
    Python, something that is not a dict: ignored)."""
    params = request.kv_transfer_params
    return params if isinstance(params, dict) else {}


def _remote_prefill(request: Request) -> bool:
    """Whether the request comes with a hand-off to read. Only ``true`` asks for
    one: vLLM's field, from the client, where a string "false" is truthy. Any
    other value is logged once (it is then set to false) and read as false."""
    params = _params(request)
    try:
        return flag(params.get("do_remote_prefill"), "do_remote_prefill")
    except KVParamsError as exc:
        params["do_remote_prefill"] = False
        logger.warning(
            "RaydirectConnector: request %s has nothing read for it (its kv_transfer_params' "
            "%s): prefilled here",
            request.request_id,
            exc,
        )
        return False


def _remote_decode(request: Request) -> bool:
    """Whether the request asks this engine to prefill for a decode engine
    (``do_remote_decode``: ``true``; anything else that is not ``false`` or
    absent is logged, and the request finishes as any other)."""
    try:
        return flag(_params(request).get("do_remote_decode"), "do_remote_decode")
    except KVParamsError as exc:
        logger.warning(
            "RaydirectConnector: request %s is not handed over: its kv_transfer_params' %s",
            request.request_id,
            exc,
        )
        return False


def extra_config(transfer: KVTransferConfig) -> tuple[float, bool]:
    """``kv_connector_extra_config``'s ``kv_lease_duration`` and ``huge_pages``,
    checked at start; ``ValueError`` naming the key. A lease no longer than the
    read margin ends before any decode engine may read; a NaN or infinite one
    never ends, and P would hold unread blocks for ever."""
    lease = transfer.get_from_extra_config("kv_lease_duration", DEFAULT_LEASE_S)
    try:
        lease_s = lease_seconds(lease, "kv_lease_duration")
    except KVParamsError:
        raise ValueError(
            f"RaydirectConnector: kv_connector_extra_config's kv_lease_duration={lease!r}: "
            f"write a number of seconds above {READ_MARGIN_S} and at most {MAX_LEASE_S:g} (a "
            f"decode engine reads only while more than {READ_MARGIN_S}s of it is left; "
            f"{DEFAULT_LEASE_S:g} by default, as NixlConnector's)"
        ) from None
    huge = transfer.get_from_extra_config("huge_pages", True)
    if not isinstance(huge, bool):
        raise ValueError(
            f"RaydirectConnector: kv_connector_extra_config's huge_pages={huge!r}: write "
            "true (the KV cache moves onto huge pages when it is exported: faster reads, "
            "0.03-2.3 ms per MiB once at start) or false (left as vLLM allocated it)"
        )
    return lease_s, huge


def fingerprint(vllm_config: VllmConfig) -> dict[str, str]:
    """What must be equal on both engines for one's KV to mean the same to the
    other (as NixlConnector's compatibility hash): checkpoints of one
    architecture, or two cache dtypes of one size, lay out alike and would
    decode garbage. Plain values, so a mismatch names the field. Workers call it
    once their model is loaded (the attention backends are known then)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    assert vllm_config.kv_transfer_config is not None
    model_id = vllm_config.kv_transfer_config.get_from_extra_config("kv_model_id", None)
    if model_id is not None and not (isinstance(model_id, str) and 0 < len(model_id) <= 1024):
        raise ValueError(
            f"RaydirectConnector: kv_connector_extra_config's kv_model_id={model_id!r}: write "
            "a name for the checkpoint (engines that load one checkpoint from different "
            "paths set the same one), or leave it out (the model's path or name)"
        )
    try:
        assert get_current_attn_backends is not None, "no get_current_attn_backends here"
        backends = ",".join(sorted(b.get_name() for b in get_current_attn_backends(vllm_config)))
    except Exception as exc:  # an engine without attention layers found: still comparable
        backends = f"unknown ({type(exc).__name__})"
    return {
        "connector": FINGERPRINT_VERSION,
        "vllm": str(vllm.__version__),
        "model": model_id or str(model.model),
        "revision": str(model.revision),
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "kv_heads": str(model.get_total_num_kv_heads()),
        "head_size": str(model.get_head_size()),
        "layers": str(model.get_total_num_hidden_layers()),
        "attention": backends,
    }
