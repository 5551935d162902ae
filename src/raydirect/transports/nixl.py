"""``nixl``: one-sided reads through NVIDIA NIXL's UCX backend (CPU and CUDA memory).

Optional: ``pip install raydirect[nixl]`` (``nixl-cu12``), imported on first use.

Producer: one NIXL agent per process, made on first export. Each tensor's
storage is registered once and shared by every object that uses it (counted);
the registration is released when no object uses it any more. An object's
metadata carries the agent's name, its connection info, and one small partial
metadata section per registration (~350 + ~220 bytes here), so no side channel
is needed. Consumer: the same per-process agent loads a remote agent's
connection once and each registration's section once, registers the receive
buffers, posts one READ for all tensors and polls it against the deadline, then
READs the object's seal (``_region_seals``; each slab registered once): UCX
reads a dropped registration's memory as readily as a live one's.

Freeing: ``garbage_collect`` releases an object's registrations; until every
byte transport's extracted state reaches ``garbage_collect``, a finalizer on the
object's first flat buffer does the same when the store drops the object.
Figures and their commands: docs/nixl.md.
"""

from __future__ import annotations

import base64
import functools
import importlib
import importlib.util
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raydirect import _process
from raydirect._ranges import Ranges
from raydirect._region_seals import seal_value, seals
from raydirect.errors import ProducerLostError, TransferError
from raydirect.transports.base import ByteTransport, PeerMetadata, TensorTransportMetadata

log = logging.getLogger("raydirect")

INSTALL_HINT = "pip install raydirect[nixl]  (or: pip install nixl-cu12)"
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_api: Any = None
_api_lock = threading.Lock()


def _nixl_api() -> Any:
    """NIXL's Python API module (``nixl`` meta package, or a ``nixl_cuXX`` wheel)."""
    global _api
    with _api_lock:
        if _api is None:
            errors = []
            for name in _MODULES:
                try:
                    _api = importlib.import_module(name)
                    break
                except ImportError as exc:
                    errors.append(f"{name}: {exc}")
            else:
                raise ImportError(
                    "tensor_transport='nixl' needs NVIDIA NIXL, which is not installed "
                    f"({'; '.join(errors)}). Install it with: {INSTALL_HINT}"
                )
        return _api


@functools.cache
def installed() -> bool:
    """Whether NIXL can be imported here, found without importing it (cheap)."""
    return any(importlib.util.find_spec(name.split(".")[0]) is not None for name in _MODULES)


def available() -> bool:
    try:
        _nixl_api()
    except ImportError:
        return False
    return True


ERROR_MODE_ENV = "RAYDIRECT_NIXL_UCX_ERROR_MODE"
UCX_INFO_ENV = "RAYDIRECT_NIXL_UCX_INFO"
_CUDA_TLS = ("cuda_copy", "cuda_ipc")


def ucx_settings(env: dict[str, str], cuda: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(the UCX backend's init parameters, environment variables to set) for a NIXL
    agent made in a process whose environment is ``env``; ``cuda``: it uses CUDA.

    Why NIXL moved device memory at 0.45 GB/s on one H200 (500x slower than
    cuda_ipc): NIXL's UCX backend makes its endpoints with peer error handling,
    and UCX then selects only lanes whose transport can report a peer's failure.
    cuda_ipc and the shared-memory transports cannot, so on one node every byte
    went over UCX's tcp through host memory (ai-dynamo/nixl#1739, #2050 say the
    same of ROCm's IPC). ``RAYDIRECT_NIXL_UCX_ERROR_MODE=none`` makes those lanes
    eligible; the price is UCX's own notice of a dead peer, which on one node
    raydirect's pid check gives anyway, and across nodes the read's deadline.
    ``auto`` never picks NIXL on one node for CUDA memory (cuda_ipc does it).

    ``UCX_TLS``, where set and CUDA is used, gets ``cuda_copy,cuda_ipc`` added:
    without them UCX stages device memory through host buffers itself.
    ``RAYDIRECT_NIXL_UCX_INFO=1`` sets ``UCX_PROTO_INFO=y``: UCX prints the
    protocol and transport it picks for each kind of transfer."""
    params: dict[str, str] = {}
    mode = env.get(ERROR_MODE_ENV, "").strip().lower()
    if mode:
        if mode not in ("peer", "none"):
            raise ValueError(f"{ERROR_MODE_ENV}={mode!r}: write 'peer' (UCX's default) or 'none'")
        params["ucx_error_handling_mode"] = mode
    changes: dict[str, str] = {}
    tls = env.get("UCX_TLS")
    if cuda and tls and not tls.startswith("^"):
        wanted = [t for t in _CUDA_TLS if t not in tls.split(",") and "cuda" not in tls.split(",")]
        if wanted:
            changes["UCX_TLS"] = ",".join([tls, *wanted])
    if env.get(UCX_INFO_ENV) == "1" and "UCX_PROTO_INFO" not in env:
        changes["UCX_PROTO_INFO"] = "y"
    return params, changes


PROGRESS_DELAY_ENV = "RAYDIRECT_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 1000


def _new_agent(api: Any, name: str, config: Any) -> Any:
    """A NIXL agent whose progress thread pauses between polls.

    NIXL's Python API hard-codes the progress thread's delay to 0, so the
    thread polls without pause and takes a core for as long as the process
    lives (measured here: 95% of a core idle, 4% with 1 ms). Its C++ config
    has the knob; this sets it, through a subclass whose ``pthrDelay`` keeps
    our value when the API assigns 0. The target side of a read needs the
    progress thread (without one, reads over UCX's tcp never complete).
    """
    delay = int(os.environ.get(PROGRESS_DELAY_ENV, DEFAULT_PROGRESS_DELAY_US))
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay)

    with _api_lock:  # the API module is shared: patch it only while building
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


def _log_ucx(agent: Any, changes: dict[str, str]) -> None:
    """Say how UCX was set up (info: once per process), so a slow NIXL read can be
    told apart: peer error handling keeps device memory off cuda_ipc."""
    try:
        params = agent.get_backend_params("UCX")
    except Exception:  # noqa: BLE001 (an older NIXL: the rest still says enough)
        params = {}
    log.info(
        "raydirect: NIXL's UCX backend: error handling %s, UCX_TLS=%s%s (%s=1 prints "
        "UCX's choice of transports)",
        params.get("ucx_error_handling_mode", "peer (NIXL's default)"),
        os.environ.get("UCX_TLS", "(unset: all)"),
        f", set here: {changes}" if changes else "",
        UCX_INFO_ENV,
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _mem(device: torch.device) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


# A READ: the local and remote descriptors (address, bytes, device), their memory kinds.
_Xfer = tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], str, str]


@dataclass
class _Region:
    serial: int
    base: int
    size: int
    descs: Any  # nixlRegDList, for deregistration
    section: str  # base64 partial agent metadata describing this registration
    users: int = 0


@dataclass
class _Remote:
    name: str
    regions: dict[int, tuple[int, int]] = field(default_factory=dict)  # serial -> (base, size)


class NixlTransport(ByteTransport):
    name = "nixl"
    one_sided = True
    devices = ("cpu", "cuda")
    extract_in_background = True  # registration costs up to seconds on first use
    notify_sent = True
    sealed = True  # a READ of the seal after the data: deregistering revokes nothing

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._agent: Any = None
        self._conn = ""  # base64 connection-only metadata of our agent
        self._serials = 0
        self._regions: dict[tuple[str, int, int, int], _Region] = {}
        self._objects: dict[bytes, list[tuple[str, int, int, int]]] = {}
        self._seal_slabs: dict[int, _Region] = {}  # by address; registered for good
        self._remotes: dict[str, _Remote] = {}

    # -- both sides
    def agent(self) -> Any:
        """This process's NIXL agent (made on first use)."""
        with self._lock:
            if self._agent is None:
                api = _nixl_api()
                cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
                params, changes = ucx_settings(dict(os.environ), cuda)
                os.environ.update(changes)  # read by UCX when the backend starts, below
                config = api.nixl_agent_config(
                    enable_prog_thread=True,
                    enable_listen_thread=False,
                    backends=[] if params else ["UCX"],  # with params: made below
                    sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
                )
                name = f"rd-{_process.PID}-{_process.PROCESS_TOKEN.hex()[:12]}"
                started = time.perf_counter()
                agent = _new_agent(api, name, config)
                if params:
                    agent.create_backend("UCX", params)
                _log_ucx(agent, changes)
                if "UCX" not in agent.backends:
                    raise TransferError("NIXL's UCX backend failed to start in this process")
                empty = api.nixlBind.nixlRegDList(api.nixlBind.DRAM_SEG)
                self._conn = _b64(agent.get_partial_agent_metadata(empty, inc_conn_info=True))
                self._agent = agent
                log.debug(
                    "raydirect: NIXL agent %s up in %.2fs", name, time.perf_counter() - started
                )
            return self._agent

    def reachable(self, extra: dict[str, Any]) -> bool:
        return bool(extra) and available()

    # -- producer
    def extract_tensor_transport_metadata(
        self, obj_id: bytes, tensors: list[torch.Tensor]
    ) -> TensorTransportMetadata:
        agent = self.agent()
        descs: list[list[int] | None] = []
        sections: dict[str, list[Any]] = {}
        keys: list[tuple[str, int, int, int]] = []
        with self._lock:
            try:
                for t in tensors:
                    if t.numel() == 0:
                        descs.append(None)
                        continue
                    storage = t.untyped_storage()
                    mem, dev = _mem(t.device)
                    key = (mem, dev, storage.data_ptr(), storage.nbytes())
                    region = self._regions.get(key)
                    if region is None:
                        region = self._regions[key] = self._register(
                            agent, (key[2], key[3], dev), mem
                        )
                    if key not in keys:
                        keys.append(key)
                        region.users += 1
                    sections[str(region.serial)] = [region.base, region.size, region.section]
                    descs.append([t.data_ptr(), t.numel(), dev, region.serial, mem == "VRAM"])
            except BaseException:
                self._drop(keys)
                raise
            self._objects[obj_id] = keys
        # Until byte transports' extracted state reaches garbage_collect, release
        # when the store drops the object (it holds the only reference to these views).
        if tensors:
            weakref.finalize(tensors[0], self._release, obj_id)
        extra = {"agent": agent.name, "conn": self._conn, "regions": sections, "descs": descs}
        return TensorTransportMetadata(tensor_meta=[], extra=extra)

    def with_seal(self, extra: dict[str, Any], slot: int) -> dict[str, Any]:
        """Where the seal's word lies (the reader READs it after the data; no slot):
        in the slab's registration, one per slab, kept while the process lives."""
        base, size, word = seals.address(slot)
        with self._lock:
            region = self._seal_slabs.get(base)
            if region is None:
                region = self._seal_slabs[base] = self._register(self.agent(), (base, size, 0))
        sections = {**extra["regions"], str(region.serial): [base, size, region.section]}
        return {**extra, "regions": sections, "seal_at": [word, region.serial]}

    def _register(self, agent: Any, where: tuple[int, int, int], mem: str = "DRAM") -> _Region:
        """A registration of ``where`` (address, size, device) and its section."""
        base, size, _ = where
        reg = agent.register_memory([(*where, "")], mem, backends=["UCX"])
        section = _b64(agent.get_partial_agent_metadata(reg, inc_conn_info=False))
        self._serials += 1
        return _Region(self._serials, base, size, reg, section)

    def _drop(self, keys: list[tuple[str, int, int, int]]) -> None:
        with self._lock:
            for key in keys:
                region = self._regions.get(key)
                if region is None:
                    continue
                region.users -= 1
                if region.users <= 0:
                    del self._regions[key]
                    try:
                        self._agent.deregister_memory(region.descs, backends=["UCX"])
                    except Exception:
                        log.exception("raydirect: NIXL deregistration failed")

    def _release(self, obj_id: bytes) -> None:
        with self._lock:
            keys = self._objects.pop(obj_id, None)
            if keys is not None:
                self._drop(keys)

    def garbage_collect(self, obj_id: bytes, meta: Any, tensors: Sequence[torch.Tensor]) -> None:
        self._release(obj_id)

    def registered_bytes(self) -> tuple[int, int]:
        """(registrations, bytes) this process has registered for objects it holds."""
        with self._lock:
            return len(self._regions), sum(r.size for r in self._regions.values())

    # -- consumer
    def _load_remote(self, agent: Any, extra: dict[str, Any]) -> str:
        name: str = extra["agent"]
        with self._lock:
            remote = self._remotes.get(name)
            sections = {int(s): v for s, v in extra["regions"].items()}
            if remote is not None:
                fresh = {s: v for s, v in sections.items() if s not in remote.regions}
                # An address range registered again (new serial) overlapping one we
                # loaded: drop every stale section by forgetting the agent.
                if any(
                    b < ob + os_ and ob < b + sz
                    for b, sz, _ in fresh.values()
                    for ob, os_ in remote.regions.values()
                ):
                    self._forget(agent, name)
                    remote = None
            if remote is None:
                loaded = agent.add_remote_agent(base64.b64decode(extra["conn"]))
                if isinstance(loaded, bytes):
                    loaded = loaded.decode()
                if loaded != name:
                    raise TransferError(f"NIXL metadata names agent {loaded!r}, expected {name!r}")
                remote = self._remotes[name] = _Remote(name)
            for serial, (base, size, section) in sections.items():
                if serial not in remote.regions:
                    agent.add_remote_agent(base64.b64decode(section))
                    remote.regions[serial] = (base, size)
        return name

    def _forget(self, agent: Any, name: str) -> None:
        with self._lock:
            if self._remotes.pop(name, None) is not None:
                try:
                    agent.remove_remote_agent(name)
                except Exception:
                    log.debug("raydirect: NIXL could not remove agent %s", name, exc_info=True)

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        targets = ranges.dests  # whole tensors: this transport is not ``ranged``
        if not extra:
            raise TransferError(f"the object of {link.who} carries no NIXL metadata")
        local, remote, mem, remote_mem = [], [], "DRAM", "DRAM"
        for t, d in zip(targets, extra["descs"], strict=True):
            if d is None or t.numel() == 0:
                continue
            if d[1] != t.numel():
                raise TransferError(f"NIXL descriptor of {d[1]} bytes for a {t.numel()} buffer")
            mem, dev = _mem(t.device)
            remote_mem = "VRAM" if d[4] else "DRAM"
            local.append((t.data_ptr(), t.numel(), dev))
            remote.append((d[0], d[1], d[2]))
        if not local:
            return
        link.check_alive()
        self._read(self.agent(), obj_id, extra, (local, remote, mem, remote_mem), link)

    def _read(
        self,
        agent: Any,
        obj_id: bytes,
        extra: dict[str, Any],
        descs: _Xfer,
        link: PeerMetadata,
    ) -> None:
        """One READ of every tensor, then one of the seal: if it still holds once the
        last byte landed, the producer had not freed the memory read."""
        local, _, mem, _ = descs
        seal = _seal_of(obj_id, extra, link)
        found = np.zeros(1, dtype=np.uint64)
        regs: list[Any] = []
        name: str = extra["agent"]
        try:
            self._load_remote(agent, extra)
            regs.append(agent.register_memory([(*d, "") for d in local], mem, backends=["UCX"]))
            self._transfer(agent, name, descs, link)
            landing = (found.ctypes.data, 8, 0)
            regs.append(agent.register_memory([(*landing, "")], "DRAM", backends=["UCX"]))
            self._transfer(agent, name, ([landing], [seal[0]], "DRAM", "DRAM"), link)
            if int(found[0]) != seal[1]:
                link.check_alive()  # an exited producer: it says so
                raise ProducerLostError.by_seal(link.who, extra)
        except (TimeoutError, ProducerLostError):
            raise
        except Exception as exc:
            lost = self._lost(link, exc)
            if lost:
                self._forget(agent, name)
                raise ProducerLostError.of(link.who, lost) from exc
            if isinstance(exc, TransferError):
                raise
            raise TransferError(
                f"NIXL READ from {link.who} failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            for reg in regs:
                try:
                    agent.deregister_memory(reg, backends=["UCX"])
                except Exception:
                    log.debug("raydirect: NIXL deregistration failed", exc_info=True)

    @staticmethod
    def _transfer(agent: Any, name: str, descs: _Xfer, link: PeerMetadata) -> None:
        """One READ from agent ``name``, polled against the deadline; its handle released."""
        local, remote, mem, remote_mem = descs
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, mem),
            agent.get_xfer_descs(remote, remote_mem),
            name,
            backends=["UCX"],
        )
        try:
            state = agent.transfer(handle)
            pause = 50e-6
            while state == "PROC":
                link.check_deadline()
                time.sleep(pause)
                pause = min(pause * 2, 2e-3)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL READ from {link.who} ended in state {state}")
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception:
                log.debug("raydirect: NIXL transfer handle release failed", exc_info=True)

    @staticmethod
    def _lost(link: PeerMetadata, exc: BaseException) -> str | None:
        """Why the producer is gone, if the failure ``exc`` came from its loss."""
        if not link.producer_alive():
            return "is no longer running"
        if type(exc).__name__ == "nixlRemoteDisconnectError":
            return "disconnected (NIXL_ERR_REMOTE_DISCONNECT)"
        return None


def _seal_of(obj_id: bytes, extra: dict[str, Any], link: PeerMetadata) -> tuple[Any, int]:
    """(the descriptor of the object's seal word, what it must hold)."""
    at = extra.get("seal_at")
    word, serial = at if isinstance(at, list) and len(at) == 2 else (None, None)
    if type(word) is not int or word <= 0 or str(serial) not in extra["regions"]:
        raise TransferError(f"corrupt transport metadata from {link.who}: seal_at={at!r}")
    return (word, 8, 0), seal_value(obj_id, link.capability)


def _forget_after_fork() -> None:
    global _api, _api_lock
    _process.keep_from_parent(_api)
    _api, _api_lock = None, threading.Lock()  # the NIXL agent is the parent's


os.register_at_fork(after_in_child=_forget_after_fork)
