"""A target on another device than the published tensors: where the bytes land
(straight in the target, or in scratch the transport writes, copied over once),
and the refusal, before a byte moves, of a pair no read can bring together.

This machine has no GPU and torch allocates on no other device type here
(``meta`` holds no memory), so the cross-device loads themselves run in
``tests/gpu/test_gpu.py``. Here: the route each declared transport gets, the
staged path run on host memory with real reads, the consumer refusing ranges
its transport cannot write, and the refusals with real Ray.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

import raydirect as rd
from raydirect import _assembly
from raydirect._consumer import _writable, fetch_ranges
from raydirect._payload import get_deferred
from raydirect._ranges import Ranges
from raydirect.transports.registry import transport_class

from actors import TensorParallel, Trainer, make_weights

COUNT = 7
CPU, CUDA = frozenset({"cpu"}), frozenset({"cpu", "cuda"})


def _route(published: str, target: str, transport: str | None) -> _assembly.Place | None:
    """Where a run bound for a ``target`` tensor lands first when ``transport``
    reads it (None: a producer in this process): None for the target itself."""
    writes = None if transport is None else _writable(transport_class(transport))
    rows = np.zeros(1, np.int64)
    if _assembly.direct_rows(rows, rows, [target], [writes])[0]:
        return None
    return _assembly.place_for(torch.device(target), False, published)


PINNED_HOST = _assembly.Place(torch.device("cpu"), pinned=True)


@pytest.mark.parametrize(
    ("published", "target", "transport", "lands"),
    [
        ("cuda", "cpu", "cuda_ipc", None),  # a device-to-host copy into the target itself
        ("cuda", "cuda", "cuda_ipc", None),
        ("cpu", "cuda", "cma", PINNED_HOST),  # cma writes host memory: staged, copied once
        ("cpu", "cuda", "shm", PINNED_HOST),
        ("cpu", "cuda", "tcp", PINNED_HOST),
        ("cpu", "cuda", "gloo", PINNED_HOST),
        ("cpu", "cpu", "cma", None),
        ("cuda", "cpu", "nccl", _assembly.Place(torch.device("cuda"))),  # nccl writes GPUs only
        ("cuda", "cpu", "nixl", None),  # nixl moves cpu and cuda memory
        ("cpu", "cuda", "nixl", None),
        ("cpu", "cuda", None, None),  # this process's own tensors: torch copies them over
    ],
)
def test_each_declared_transport_gets_its_route(published, target, transport, lands):
    assert _route(published, target, transport) == lands


def test_mixed_targets_route_per_row():
    """One rank, targets on two device types: each row by its own target."""
    ranks = np.zeros(4, np.int64)
    dests = np.array([0, 1, 1, 0])
    got = _assembly.direct_rows(ranks, dests, ["cpu", "cuda"], [_writable(transport_class("cma"))])
    assert got.tolist() == [True, False, False, True]
    two = _assembly.direct_rows(np.array([0, 1]), np.array([1, 1]), ["cpu", "cuda"], [CPU, None])
    assert two.tolist() == [False, True]  # the second rank is this process: copied over


def test_the_refusals_name_the_fix():
    meta = _assembly.target_refusal(torch.device("meta"), CUDA)
    assert meta is not None and "to_empty" in meta
    gpu = _assembly.target_refusal(torch.device("cuda", 0), CPU)
    assert gpu is not None and "num_gpus" in gpu
    assert _assembly.target_refusal(torch.device("cuda", 1), CUDA) is None
    assert _assembly.target_refusal(torch.device("cpu"), CPU) is None
    published = _assembly.published_refusal("cuda", CPU)
    assert published is not None and "num_gpus" in published and "host memory" in published
    assert _assembly.published_refusal("cuda", CUDA) is None
    assert _assembly.published_refusal("cpu", CPU) is None
    assert _assembly.usable_devices() == (CUDA if torch.cuda.is_available() else CPU)


def _received() -> int:
    return sum(rd.local_stats().bytes_received.values())


def test_a_meta_target_is_refused_before_a_byte_moves(ray_session):
    trainer = Trainer.remote(COUNT)
    try:
        want = make_weights(COUNT)
        target = {n: torch.zeros_like(t) for n, t in want.items()}
        target["colpar0"] = torch.empty_like(want["colpar0"], device="meta")
        sub = rd.WeightSubscriber(target)
        before = _received()
        with pytest.raises(rd.WeightSyncError) as info:
            sub.load(trainer.publish.remote(1), timeout=60)
        message = str(info.value)
        assert "'colpar0': the target is on meta" in message and "to_empty" in message, message
        assert message.endswith("nothing was written"), message
        assert _received() == before and sub.version is None
        assert all(not t.any() for n, t in target.items() if n != "colpar0")
        target["colpar0"] = torch.empty_like(want["colpar0"], device="cpu")  # the fix
        assert sub.load(trainer.publish.remote(2), timeout=60) == 2
        assert all(torch.equal(target[n], want[n]) for n in want)
    finally:
        ray.kill(trainer)


def _staged_load(sub: rd.WeightSubscriber, handle: rd.WeightsHandle) -> _assembly.Load:
    """``sub``'s plan for ``handle`` assembled as if its transport could not write
    host memory: every run is read into scratch, then copied over."""
    planned = sub._plan_for([handle])
    payloads = sub._payloads([handle], None, handle.version)
    load = _assembly.assembled(planned.plan, planned.dests, [frozenset({"cuda"})], "cpu")
    _assembly.read_all(load, payloads, time.monotonic() + 60)
    load.finish()
    return load


@pytest.mark.parametrize("world", [1, 2], ids=["whole", "tp2"])
def test_staged_reads_land_exactly_after_the_copy(ray_session, world):
    """The path a CPU trainer's bytes take to a GPU target, on host memory: real
    reads over cma into scratch, then one batch of copies, whole and sharded."""
    trainer = Trainer.remote(COUNT)
    try:
        shard = TensorParallel(1, world) if world > 1 else None
        want = make_weights(COUNT)
        if shard is not None:
            want = {n: shard.take(n, t).contiguous() for n, t in want.items()}
        target = {n: torch.zeros_like(t) for n, t in want.items()}
        sub = rd.WeightSubscriber(target, shard=shard)
        handle = ray.get(trainer.publish.remote(1))
        load = _staged_load(sub, handle)
        assert load.copies and all(r.devices == CPU for _, r in load.reads)
        assert sum(s.numel() for s in load.scratch) == sum(t.nbytes for t in want.values())
        assert all(torch.equal(target[n], want[n]) for n in want)
    finally:
        ray.kill(trainer)


def test_a_load_keeps_its_assembly_while_the_routes_stay(ray_session):
    trainer = Trainer.remote(COUNT)
    try:
        target = {n: torch.zeros_like(t) for n, t in make_weights(COUNT).items()}
        sub = rd.WeightSubscriber(target)
        sub.load(trainer.publish.remote(1), timeout=60)
        [planned] = sub._plans.values()
        first = planned._made
        ray.get(trainer.step.remote())
        sub.load(trainer.publish.remote(2), timeout=60)
        assert planned._made is first  # the same routes: assembled once
        assert torch.equal(target["colpar0"], make_weights(COUNT)["colpar0"] + 1)
    finally:
        ray.kill(trainer)


def test_ranges_a_transport_cannot_write_are_refused_before_it_reads(ray_session):
    """A read that fell back to a transport that cannot write where its ranges
    land (host bytes to a device address) is refused, not run."""
    trainer = Trainer.remote(COUNT)
    try:
        handle = ray.get(trainer.publish.remote(1))
        [pending] = get_deferred([handle.ref], 60)
        dest = torch.zeros(16, dtype=torch.uint8)
        one = np.ones(1, np.int64)
        ranges = Ranges(
            np.zeros(1, np.int64), np.zeros(1, np.int64), one * 16, one, one * 16, [dest],
            devices=frozenset({"cuda"}),
        )  # fmt: skip
        with pytest.raises(rd.TransportUnavailableError, match="writes cpu memory.*cuda memory"):
            fetch_ranges(pending.payload, ranges, time.monotonic() + 60)
        assert not dest.any()
        before = rd.local_stats().bytes_received.get("cma", 0)
        ranges.devices = CPU
        fetch_ranges(pending.payload, ranges, time.monotonic() + 60)
        assert dest.any()  # the same read, landing where cma writes ...
        assert rd.local_stats().bytes_received.get("cma", 0) == before + 16  # ... still cma
    finally:
        ray.kill(trainer)
