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
import logging
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
from raydirect.transports.nixl_agent import available, make_agent, nixl_api

log = logging.getLogger("raydirect")


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
                cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
                name = f"rd-{_process.PID}-{_process.PROCESS_TOKEN.hex()[:12]}"
                agent = make_agent(name, cuda)
                bind = nixl_api().nixlBind
                empty = bind.nixlRegDList(bind.DRAM_SEG)
                self._conn = _b64(agent.get_partial_agent_metadata(empty, inc_conn_info=True))
                self._agent = agent
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
        name: str = extra["agent"]
        reg = None
        try:
            self._load_remote(agent, extra)
            reg = agent.register_memory([(*d, "") for d in local], mem, backends=["UCX"])
            self._transfer(agent, name, descs, link)
            if not self._seal_holds(agent, name, seal, link):
                link.check_alive()  # an exited producer: it says so
                raise ProducerLostError.by_seal(link.who, extra)
        except (TimeoutError, ProducerLostError):
            raise
        except Exception as exc:
            lost = self._lost(link, exc)
            if lost:
                self._forget(agent, name)
                if self._freed_under_read(agent, extra, seal, link):
                    raise ProducerLostError.by_seal(link.who, extra) from exc
                raise ProducerLostError.of(link.who, lost) from exc
            if isinstance(exc, TransferError):
                raise
            raise TransferError(
                f"NIXL READ from {link.who} failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            _deregister(agent, reg)

    def _seal_holds(self, agent: Any, name: str, seal: tuple[Any, int], link: PeerMetadata) -> bool:
        """READ the seal's word from agent ``name``: does it hold what it must?"""
        found = np.zeros(1, dtype=np.uint64)
        landing = (found.ctypes.data, 8, 0)
        reg = agent.register_memory([(*landing, "")], "DRAM", backends=["UCX"])
        try:
            self._transfer(agent, name, ([landing], [seal[0]], "DRAM", "DRAM"), link)
        finally:
            _deregister(agent, reg)
        return int(found[0]) == seal[1]

    def _freed_under_read(
        self, agent: Any, extra: dict[str, Any], seal: tuple[Any, int], link: PeerMetadata
    ) -> bool:
        """After a lost connection to a producer that lives: had it freed the object?
        UCX drops the connection when a READ finds the memory unmapped (a large
        object freed); the seal, in a slab mapped for the producer's life, tells
        that from a connection really lost. Asked on a new connection."""
        if not link.producer_alive():
            return False
        try:
            self._load_remote(agent, extra)
            return not self._seal_holds(agent, extra["agent"], seal, link)
        except Exception:  # noqa: BLE001 (the connection stays lost: say so)
            log.debug("raydirect: NIXL could not read the seal again", exc_info=True)
            return False

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


def _deregister(agent: Any, reg: Any) -> None:
    if reg is None:
        return
    try:
        agent.deregister_memory(reg, backends=["UCX"])
    except Exception:
        log.debug("raydirect: NIXL deregistration failed", exc_info=True)


def _seal_of(obj_id: bytes, extra: dict[str, Any], link: PeerMetadata) -> tuple[Any, int]:
    """(the descriptor of the object's seal word, what it must hold)."""
    at = extra.get("seal_at")
    word, serial = at if isinstance(at, list) and len(at) == 2 else (None, None)
    if type(word) is not int or word <= 0 or str(serial) not in extra["regions"]:
        raise TransferError(f"corrupt transport metadata from {link.who}: seal_at={at!r}")
    return (word, 8, 0), seal_value(obj_id, link.capability)
