"""Long-lived regions, the owner's side: export, notices, close.

An object (``rd.method``, ``rd.put``) lives as long as Ray's reference counting
says, and its tensors are not to be written while it does. A region is the
other kind of memory: a KV cache, a staging or ring buffer, exported once,
written all the time, read in ranges by whoever holds its handle, for as long
as its owner says. So a region has no lease, no Ray object and no in-place
write warning; it is open from ``export_region`` until ``Region.close()`` or
its owner's death.

It is held in the store beside objects (``store.add_region``), so the agent
finds it, checks its capability and serves ranged reads of it exactly as it
does an object's (``shm``, ``tcp``); ``cma`` readers need no agent. What makes
closing safe while reads run (the owner may reuse the memory once ``close``
returns):

1. the store drops it: every agent request naming it is answered "lost";
2. its seal is zeroed (``transports.cma``): a cross-memory read checks the seal
   before and after it reads, so one that overlapped the close fails;
3. reads the agent is serving (copying out of the memory: ``shm``, ``tcp``'s
   copy) are waited for (``Serving``), and plug-in reads prepared from it are
   released (their release, which checks the region, fails);
4. transports release what they set up (``garbage_collect``).

Readers notify the owner (``rd.notify_region``, ``read_ranges(notify=)``):
the agent (``_region_serve``) queues each message for ``Region.notices()`` or
hands it to the ``on_notice`` callback on a thread of its own, at once, with
no polling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from raydirect import _huge_pages, _process, _ray, _runtime
from raydirect import _region_serve as served
from raydirect._payload import check_usable_here
from raydirect._ranges import ByteViews
from raydirect._region_handle import RegionHandle, encode_meta
from raydirect._region_seals import region_extent
from raydirect._region_serve import OpenRegion
from raydirect._split import not_dense
from raydirect._store import Serving, StoredObject, capability_of, store
from raydirect._tensors import UNTRACKED, describe_all, flat_bytes
from raydirect._timeouts import checked_timeout
from raydirect.transports.registry import AUTO, check_name, registration, transport_instance

# What readers may name: one-sided byte transports (the agent serves or the
# reader reads alone) and one-sided plug-ins; not the groups' two-sided sends.
_READ_BY = frozenset({AUTO, "cma", "shm", "tcp"})
_SLOW_COLLAPSE_S = 1.0  # a move onto huge pages this long is logged

log = logging.getLogger("raydirect")


class Region:
    """A set of tensors exported once, read in ranges by any process holding its
    ``handle()``, until ``close()`` (or this process's end). Made by
    ``rd.export_region``; usable as a context manager (closed on exit)."""

    def __init__(self, state: OpenRegion, handle: RegionHandle) -> None:
        self._state = state
        self._handle = handle
        self._lock = threading.Lock()
        self._closing = False
        self._closed = False

    @property
    def name(self) -> str:
        return self._handle.name

    @property
    def nbytes(self) -> int:
        """Bytes the region exposes (its tensors' sizes summed)."""
        return sum(self._handle.nbytes)

    @property
    def closed(self) -> bool:
        return self._closed

    def handle(self) -> RegionHandle:
        """What readers need: small, picklable, JSON-safe (``to_json()``). Holding
        it lets a process read this region and notify its owner, nothing else."""
        return self._handle

    def notices(self, timeout: float | None = 0.0) -> list[Any]:
        """The notices readers sent since the last call, oldest first. With none
        waiting, waits up to ``timeout`` seconds (None: until one comes) for one,
        without polling; returns ``[]`` at once once the region is closed."""
        state = self._state
        if state.on_notice is not None:
            raise ValueError(f"region {self.name!r} hands its notices to on_notice")
        timeout = checked_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with state.cond:
            while not state.inbox and not state.closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                state.cond.wait(remaining)
            taken = list(state.inbox)
            state.inbox.clear()
        return taken

    def close(self, timeout: float | None = None) -> None:
        """Stop serving the region. Every read that has not returned by then fails
        with ``rd.ProducerLostError``, naming it; none returns bytes read after
        this call began. When ``close`` returns, nothing of raydirect reads the
        tensors any more: write, free or reuse their memory as you like (raydirect
        never frees it; the tensors are yours). Reads the agent is serving, and
        reads in this process, are waited for (each a copy of at most the rows it
        asked for): past
        ``timeout`` seconds ``TimeoutError`` (the region is closed to new reads;
        call ``close`` again before reusing the memory). Closing twice is a no-op."""
        state = self._state
        with self._lock:
            if self._closed:
                return
            first, self._closing = not self._closing, True
        if first:
            _revoke(state)
        live = state.obj.live
        assert live is not None
        if not live.close(checked_timeout(timeout)):
            raise TimeoutError(
                f"region {self.name!r}: reads its agent is serving still copy from its memory "
                f"after {timeout}s; it is closed to new reads. Call close() again before "
                "reusing the memory"
            )
        _release(state)
        with self._lock:
            self._closed = True

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        count = len(self._handle.nbytes)
        return f"Region({self.name!r}, {count} tensors, {self.nbytes} bytes, {state})"


def _revoke(state: OpenRegion) -> None:
    """Steps 1 and 2 of a close (the module's docstring): no read starts, and
    every cross-memory read in flight fails its check."""
    store.close_region(state.obj.obj_id)  # its seal released too
    with state.cond:
        state.closed = True
        state.cond.notify_all()  # a notices() waiter returns


def _release(state: OpenRegion) -> None:
    """Steps 3 and 4, once no agent read is in flight."""
    served.release_reads(state)
    store.release(state.obj)
    served.remove(state.obj.obj_id)


def export_region(
    tensors: Any,
    *,
    name: str | None = None,
    tensor_transport: str = AUTO,
    on_notice: Callable[[Any], None] | None = None,
    huge_pages: bool = True,
) -> Region:
    """Export ``tensors`` (a dict of tensors, a list or tuple of them, or one) as
    a region that any process holding its handle reads in ranges, straight from
    this process's memory (``rd.read_ranges``), until ``Region.close()`` or this
    process ends. Nothing is copied; write the tensors whenever you like (a read
    sees the bytes as they are while it runs). Each tensor must be a contiguous
    CPU tensor (a numpy array works too).

    ``tensor_transport``: ``auto`` (each reader chooses: ``cma`` on this node,
    ``shm`` where the kernel refuses it, ``tcp`` from other nodes), a built-in
    one-sided transport (``cma``, ``shm``, ``tcp``), or a one-sided plug-in.
    ``on_notice(message)``: called for each reader's notice, on a thread of
    raydirect's, in arrival order (keep it short); without it, notices wait in
    ``Region.notices()``.
    ``huge_pages``: move the tensors' memory onto transparent huge pages before
    returning (where the kernel can: Linux 6.1+), which makes ``cma`` reads of
    long runs (a CPU KV cache's 512 KiB blocks) up to 2x faster; it takes
    0.03-2.3 ms per MiB, once. Only memory already written is moved. ``False``
    leaves the memory as it is."""
    check_usable_here()
    _ray.ensure_ray()
    names, originals, views = _tensors_of(tensors)
    transport = _checked_transport(tensor_transport)
    if on_notice is not None and not callable(on_notice):
        raise TypeError(f"on_notice must be a callable taking one message, got {on_notice!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if not isinstance(huge_pages, bool):  # huge_pages="no" from a config moved them
        raise TypeError(f"huge_pages must be True or False, got {huge_pages!r}")
    agent = _runtime.agent()
    obj = _stored(originals, views, name, transport)
    if huge_pages:
        _onto_huge_pages(views, list(obj.metas.nbytes), obj.label)
    handle = _handle_of(obj, names, agent.address)
    state = OpenRegion(obj, on_notice)
    served.add(state)
    store.add_region(obj)
    return Region(state, handle)


def _handle_of(obj: StoredObject, names: tuple[str, ...] | None, agent: str) -> RegionHandle:
    """What a reader needs: where the tensors are, the seal to check, the agent.
    Sealed here, once the addresses are known: the handle travels outside Ray
    (JSON, HTTP requests), and a ``cma`` reader copies from the addresses and
    within the sizes it names with no agent to check them, so the seal covers
    them (``region_extent``): an edited address or size fails the check."""
    cross = transport_instance("cma")  # its addresses, and the seal
    meta = cross.extract_tensor_transport_metadata(obj.obj_id, obj.buffers).extra  # type: ignore[arg-type]
    seal = store.seal(obj, region_extent(meta["ptrs"], obj.metas.nbytes))
    cma_meta = {**meta, "seal": seal, "region": True}  # "region": what a failed seal says
    encoded, frames = encode_meta({"cma": cma_meta, "shm": {"live": True}})
    return RegionHandle(
        region=obj.obj_id.hex(),
        capability=obj.capability.hex(),
        name=obj.label,
        names=names,
        nbytes=tuple(obj.metas.nbytes),
        dtypes=tuple(obj.metas.dtypes),
        shapes=tuple(tuple(s) for s in obj.metas.shapes),
        device="cpu",
        transport=obj.transport,
        agent=agent,
        node_id=_ray.node_id(),
        pid=_process.PID,
        start_time=_process.START_TIME,
        process_token=_process.PROCESS_TOKEN.hex(),
        owner=_ray.current_task_label(),
        meta=encoded,
        frames=frames,
    )


def _onto_huge_pages(views: list[torch.Tensor], lengths: list[int], label: str) -> None:
    """A region is read many times while it lives: long runs of its memory read
    up to 2x faster over ``cma`` from huge pages (``_huge_pages``)."""
    started = time.monotonic()
    moved = sum(_huge_pages.collapse(v.data_ptr(), n) for v, n in zip(views, lengths, strict=True))
    took = time.monotonic() - started
    if took >= _SLOW_COLLAPSE_S:
        log.info(
            "raydirect: region %r: %d MiB moved onto huge pages in %.1fs (faster reads for its "
            "life); export_region(huge_pages=False) skips this",
            label,
            moved >> 20,
            took,
        )


def _tensors_of(tensors: Any) -> tuple[tuple[str, ...] | None, list[Any], list[torch.Tensor]]:
    """(names, what was given, torch views of it), checked: ``TypeError``/``ValueError``."""
    if isinstance(tensors, dict):
        if not all(isinstance(k, str) for k in tensors):
            raise TypeError("export_region takes a dict with str keys (tensor names)")
        names: tuple[str, ...] | None = tuple(tensors)
        given = list(tensors.values())
    elif isinstance(tensors, (list, tuple)):
        names, given = None, list(tensors)
    else:
        names, given = None, [tensors]
    if not given:
        raise ValueError("export_region needs at least one tensor")
    views = [_view_of(t, names[i] if names else str(i)) for i, t in enumerate(given)]
    return names, given, views


def _view_of(value: Any, key: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous or value.dtype.hasobject:
            raise ValueError(f"tensor {key}: a numpy array must be C-contiguous, of plain numbers")
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"tensor {key}: expected a torch tensor or numpy array, got {type(value).__name__}"
        )
    if value.device.type != "cpu":
        raise ValueError(
            f"tensor {key} is on {value.device}: regions expose host memory for now; "
            "export a CPU tensor"
        )
    kind = not_dense(value)
    if kind is not None:
        raise ValueError(
            f"tensor {key} is {kind}: a region exposes memory as it lies, and rows count "
            "bytes from a tensor's start; export a dense tensor"
        )
    if value.is_conj() or value.is_neg():
        raise ValueError(
            f"tensor {key} is a lazily conjugated or negated view (x.conj()): its bytes are "
            "not the values it shows, and a region exposes bytes; export the tensor it views "
            "(its readers conjugate what they read)"
        )
    if value.is_quantized or not value.is_contiguous():
        raise ValueError(
            f"tensor {key} is not contiguous: a region exposes memory as it lies, and rows "
            "count bytes from a tensor's start; export a contiguous tensor (or its base)"
        )
    return value.detach()


def _checked_transport(name: str) -> str:
    name = check_name(name)
    if name in _READ_BY:
        return name
    cls = registration(name).cls
    if cls.byte_transport or not cls.is_one_sided():
        raise ValueError(
            f"tensor_transport={name!r}: a region is read one-sided, so it is read over 'auto', "
            "'cma', 'shm', 'tcp' or a one-sided plug-in transport"
        )
    return name


def _stored(
    originals: list[Any], views: list[torch.Tensor], name: str | None, transport: str
) -> StoredObject:
    obj_id = _process.new_id()
    metas = describe_all(originals, views)
    nbytes = metas.total_bytes()
    addresses = np.array([v.data_ptr() for v in views], dtype=np.int64)
    lengths = np.asarray(metas.nbytes, dtype=np.int64)
    return StoredObject(
        obj_id=obj_id,
        capability=capability_of(obj_id, nbytes),
        originals=originals,
        buffers=ByteViews(addresses, lengths, lambda i: flat_bytes(views[i])),
        metas=metas,
        versions=[UNTRACKED] * len(views),  # written in place by design: no warning
        storages=[0] * len(views),  # nor does it hold them for wait_tensor_freed
        label=name if name is not None else f"region-{obj_id.hex()[:8]}",
        transport=transport,
        nbytes=nbytes,
        live=Serving(),
    )


def open_regions() -> list[str]:
    """The names of this process's open regions (``raydirect status``, tests)."""
    return served.names()
