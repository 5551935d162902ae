"""cuda_ipc's logic on the CPU: the consumer's cache of opened producer storages,
the CUDA checks before a handle is opened, and a read's copies, with a stand-in
opener that hands out CPU storages. What needs a GPU (exporting, opening a real
handle) is tested in tests/gpu."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from raydirect import _process
from raydirect._payload import ProducerInfo
from raydirect._ranges import Ranges
from raydirect._region_seals import seal_value, seals
from raydirect.errors import ProducerLostError, TransportUnavailableError
from raydirect.transports import cuda_ipc
from raydirect.transports.base import PeerMetadata
from raydirect.transports.cuda_ipc import OpenedStorages, storage_key


def _share(handle: bytes, offset: int = 0, device: int = 0) -> list:
    # _share_cuda_'s shape: (device, handle, size, offset, counter, counter offset, event, sync)
    return [device, handle, 1024, offset, b"counter", 0, b"event", True]


class _Opener:
    """Opens a CPU storage per share, counting the openings; a storage's bytes are
    its handle's first byte repeated."""

    def __init__(self) -> None:
        self.opened: list[tuple] = []

    def __call__(self, share: list) -> torch.UntypedStorage:
        self.opened.append(storage_key(share))
        return torch.full((64,), share[1][0], dtype=torch.uint8).untyped_storage()


def test_views_of_one_storage_share_its_key():
    a, b = _share(b"h1", 512), _share(b"h1", 512)
    b[6] = b"another event"  # exported twice: a new event, the same storage
    assert storage_key(a) == storage_key(b) != storage_key(_share(b"h1", 0))


def test_each_storage_opens_once_per_object_across_tensors_and_reads():
    opener = _Opener()
    cache = OpenedStorages(opener)
    shares = [_share(b"a"), _share(b"a"), _share(b"b")]  # two views of one storage
    first = cache.storages("p", b"obj", shares)
    again = cache.storages("p", b"obj", shares)  # a second read of the object
    assert len(opener.opened) == 2
    assert first[0] is first[1] is again[0] and again[2] is first[2]
    cache.storages("p", b"other", shares[:1])  # another object: opened for itself
    assert len(opener.opened) == 3
    assert cache.counts() == (2, 3)


def test_old_and_idle_objects_close_first_and_a_dead_producers_all_at_once():
    now = [0.0]
    opener = _Opener()
    cache = OpenedStorages(opener, max_objects=2, max_idle_s=10.0, clock=lambda: now[0])
    for obj in (b"1", b"2", b"3"):
        cache.storages("p", obj, [_share(obj)])
    cache.storages("q", b"4", [_share(b"4")])
    assert cache.counts() == (2, 2)  # the two oldest went when the third and fourth came
    cache.storages("p", b"3", [_share(b"3")])  # still open: no new opening
    assert len(opener.opened) == 4
    now[0] = 11.0
    cache.storages("q", b"5", [_share(b"5")])  # 3 and 4 sat idle past 10 s
    assert cache.counts() == (1, 1)
    cache.forget_producer("q")
    assert cache.counts() == (0, 0)


class _Link(PeerMetadata):
    alive = True

    def producer_alive(self) -> bool:
        return self.alive


def _link() -> _Link:
    producer = ProducerInfo("tcp://127.0.0.1:1", "node", 1, 1, b"token", "Peer.value")
    return _Link(producer, b"cap", same_node=True)


@pytest.fixture
def cpu_opener(monkeypatch):
    """The module's cache with the stand-in opener; no CUDA checks."""
    opener = _Opener()
    monkeypatch.setattr(cuda_ipc, "opened", OpenedStorages(opener))
    monkeypatch.setattr(cuda_ipc, "ensure_cuda", lambda device, who: None)
    return opener


def _handle(share: list, offset: int, nbytes: int) -> dict:
    return {"share": share, "offset": offset, "nbytes": nbytes}


def test_a_read_copies_each_tensor_from_its_storage_opening_each_once(cpu_opener):
    a, b = _share(b"\x07"), _share(b"\x09")
    extra = {"handles": [_handle(a, 0, 8), _handle(a, 8, 4), _handle(b, 2, 3), _handle(b, 0, 0)]}
    targets = [torch.zeros(n, dtype=torch.uint8) for n in (8, 4, 3, 0)]
    link = _link()
    for _ in range(2):
        cuda_ipc.CudaIpcTransport().receive(b"obj", extra, link, Ranges.of_whole(targets))
    assert [t.tolist() for t in targets] == [[7] * 8, [7] * 4, [9] * 3, []]
    assert len(cpu_opener.opened) == 2  # two storages, two reads: opened once each


def test_a_read_from_a_dead_producer_fails_and_closes_its_storages(cpu_opener):
    extra = {"handles": [_handle(_share(b"\x01"), 0, 4)]}
    link = _link()
    target = torch.zeros(4, dtype=torch.uint8)
    cuda_ipc.CudaIpcTransport().receive(b"obj", extra, link, Ranges.of_whole([target]))
    assert cuda_ipc.opened.counts() == (1, 1)
    link.alive = False  # the opened mapping would still read: the pid check must not
    with pytest.raises(ProducerLostError, match="Peer.value"):
        cuda_ipc.CudaIpcTransport().receive(b"obj", extra, link, Ranges.of_whole([target]))
    assert cuda_ipc.opened.counts() == (0, 0)


def test_a_read_of_a_freed_object_raises_never_another_tensors_bytes(cpu_opener, monkeypatch):
    """A reader may hold a ref after the producer freed the object (Ray keeps a
    borrowed value whose owner died, and that death freed it), and the producer's
    caching allocator then gives the memory to other tensors. The seal check after
    the copies refuses a read the free raced; the one before refuses a later read
    before any copy. This process plays the producer (its seals)."""
    me = ProducerInfo("tcp://127.0.0.1:1", "node", os.getpid(), _process.START_TIME, b"t", "P.v")
    link = _Link(me, b"cap", same_node=True)
    slot = seals.take(seal_value(b"obj", b"cap"))
    extra = {"handles": [_handle(_share(b"\x07"), 0, 8)], "seal": slot}
    target = torch.zeros(8, dtype=torch.uint8)

    def read() -> None:
        cuda_ipc.CudaIpcTransport().receive(b"obj", extra, link, Ranges.of_whole([target]))

    read()
    assert target.tolist() == [7] * 8
    copy = cuda_ipc.copy_from_storages
    taken = []

    def freed_during_the_copies(*args: Any) -> bool:
        seals.release(slot)  # the free zeroes the seal first; the slot goes to the next
        taken.append(seals.take(seal_value(b"next", b"cap")))
        return copy(*args)

    monkeypatch.setattr(cuda_ipc, "copy_from_storages", freed_during_the_copies)
    try:
        with pytest.raises(ProducerLostError, match=r"P.v \(pid .*\) freed the object"):
            read()
        monkeypatch.setattr(cuda_ipc, "copy_from_storages", copy)
        target.zero_()
        with pytest.raises(ProducerLostError, match=r"P.v \(pid .*\) freed the object"):
            read()
        assert target.tolist() == [0] * 8  # refused before any copy
    finally:
        for s in taken:
            seals.release(s)


def test_cuda_is_initialised_before_a_handle_opens(monkeypatch):
    """A process that never used CUDA segfaulted in getIpcDevPtr (H200); torch's own
    rebuild_cuda_tensor initialises CUDA first, and so must we."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda_ipc.ensure_cuda(0, "Peer.value")
    assert calls == ["init"]
    with pytest.raises(TransportUnavailableError, match="CUDA_VISIBLE_DEVICES"):
        cuda_ipc.ensure_cuda(1, "Peer.value")


def test_a_process_where_cuda_cannot_start_gets_an_error_naming_the_fix(monkeypatch):
    def fail() -> None:
        raise RuntimeError("no CUDA-capable device is detected")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", fail)
    with pytest.raises(TransportUnavailableError, match="num_gpus") as info:
        cuda_ipc.ensure_cuda(0, "Peer.value")
    assert isinstance(info.value.__cause__, RuntimeError)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TransportUnavailableError, match="sees no CUDA device.*num_gpus"):
        cuda_ipc.ensure_cuda(0, "Peer.value")


# ---------------------------------------------------------------- NIXL on device memory


def test_auto_never_picks_nixl_on_one_node_for_cuda_memory():
    """NIXL moved 0.45 GB/s of device memory on one H200, cuda_ipc 500 times more."""
    from types import SimpleNamespace

    from raydirect import _choice
    from raydirect._tensors import TensorMeta, TensorMetas

    metas = TensorMetas.of([TensorMeta((4,), "float32", 16, "cuda")])
    producer = SimpleNamespace(transports=("nixl",))
    payload = SimpleNamespace(producer=producer, metas=metas, transport_meta={})
    assert _choice._choose_auto(payload, same_node=True) == "cuda_ipc"  # type: ignore[arg-type]


def test_nixl_ucx_settings_make_device_lanes_eligible_where_asked():
    from raydirect.transports.nixl_agent import ucx_settings

    assert ucx_settings({}, cuda=True) == ({}, {})  # NIXL's and UCX's defaults, untouched
    none = {"RAYDIRECT_NIXL_UCX_ERROR_MODE": "none"}
    assert ucx_settings(none, cuda=True)[0] == {"ucx_error_handling_mode": "none"}
    tls = {"UCX_TLS": "tcp,sm"}
    assert ucx_settings(tls, cuda=True)[1] == {"UCX_TLS": "tcp,sm,cuda_copy,cuda_ipc"}
    assert ucx_settings(tls, cuda=False)[1] == {}
    assert ucx_settings({"UCX_TLS": "^ib"}, cuda=True)[1] == {}  # an exclusion list keeps cuda
    info = {"RAYDIRECT_NIXL_UCX_INFO": "1"}
    assert ucx_settings(info, cuda=False)[1] == {"UCX_PROTO_INFO": "y"}
    with pytest.raises(ValueError, match="'peer'.*'none'"):
        ucx_settings({"RAYDIRECT_NIXL_UCX_ERROR_MODE": "off"}, cuda=True)
