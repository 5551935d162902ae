"""The ``nixl`` transport between real Ray actors (skipped when NIXL is not installed)."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd
from raydirect._consumer import fetch_value
from raydirect._payload import get_deferred
from raydirect.transports import nixl_agent

if not nixl_agent.available():
    pytest.skip(f"NIXL is not installed ({nixl_agent.INSTALL_HINT})", allow_module_level=True)

import actors  # noqa: E402
from helpers import wait_for  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1 << 20


def _registrations(_self: Any) -> tuple[int, int]:
    from raydirect.transports.registry import transport_instance

    return transport_instance("nixl").registered_bytes()  # type: ignore[attr-defined]


def _put_full(_self: Any, nbytes: int, fill: int) -> list[ray.ObjectRef]:
    t = torch.full((nbytes,), fill, dtype=torch.uint8)
    t[::4096] = torch.arange(t[::4096].numel()).remainder(251).to(torch.uint8)
    return [rd.put(t, tensor_transport="nixl")]


def _put_kept_twice(self: Any) -> list[ray.ObjectRef]:
    self.shared = torch.arange(1 << 16, dtype=torch.float32)
    return [rd.put({"x": self.shared}, "nixl"), rd.put({"y": self.shared[10:20]}, "nixl")]


@ray.remote(num_cpus=0)
class NixlProducer:
    def pid(self) -> int:
        return os.getpid()

    @rd.method(tensor_transport="nixl")
    def value(self, case: str) -> Any:
        return actors.make_value(case)


def patched(actor: Any) -> Any:
    """The actor, started (nothing to patch now that nixl is a built-in)."""
    ray.get(actor.__ray_ready__.remote())
    return actor


def intact(t: torch.Tensor, nbytes: int, fill: int) -> bool:
    if t.numel() != nbytes:
        return False
    marks = t[::4096]
    expected = torch.arange(marks.numel()).remainder(251).to(torch.uint8)
    rest = t.view(-1, 4096)[:, 1:]
    return bool(torch.equal(marks, expected)) and bool((rest == fill).all())


@pytest.fixture(scope="module")
def nixl_pair(ray_session):
    p = patched(actors.Producer.remote())
    c = patched(actors.Consumer.remote())
    yield p, c
    ray.kill(p)
    ray.kill(c)


@pytest.mark.parametrize("case", ["dtypes", "views", "aliasing", "params", "numpy"])
def test_values_arrive_over_nixl(nixl_pair, case):
    p, c = nixl_pair
    [ref] = ray.get(p.put.remote(case, "nixl"))
    assert ray.get(p.stats.remote()).num_objects >= 1
    assert ray.get(c.check.remote(case, ref)) is None


def test_consumer_counts_nixl_transfers(nixl_pair):
    p, _ = nixl_pair
    c = patched(actors.Producer.remote())  # a Producer has stats() and try_get()
    [ref] = ray.get(p.put.remote("dtypes", "nixl"))
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert ray.get(c.stats.remote()).objects_received.get("nixl") == 1
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert ray.get(c.stats.remote()).objects_received.get("nixl") == 2
    ray.kill(c)


def test_64_mib_intact_actor_and_driver(nixl_pair):
    p, c = nixl_pair
    size = 64 * MiB
    [ref] = ray.get(p.__ray_call__.remote(_put_full, size, 9))
    numel, second, first_marks = ray.get(c.summarize.remote(ref), timeout=120)
    assert (numel, second, first_marks) == (size, 9, list(range(8)))
    got = rd.get(ref, timeout=120, tensor_transport="nixl")  # the driver reads it too
    assert intact(got, size, 9)
    assert rd.local_stats().objects_received.get("nixl", 0) >= 1
    del got
    assert intact(ray.get(ref), size, 9)  # plain ray.get in the driver


def test_freed_objects_release_registrations(ray_session):
    p, c = patched(actors.Producer.remote()), patched(actors.Consumer.remote())
    refs = [ray.get(p.put.remote("dtypes", "nixl"))[0] for _ in range(5)]
    [big] = ray.get(p.__ray_call__.remote(_put_full, 8 * MiB, 3))
    for ref in refs:
        assert ray.get(c.check.remote("dtypes", ref)) is None
    assert ray.get(c.summarize.remote(big))[1] == 3
    count, nbytes = ray.get(p.__ray_call__.remote(_registrations))
    assert count >= 1 and nbytes >= 8 * MiB
    del refs, big, ref
    wait_for(lambda: ray.get(p.stats.remote()).num_objects == 0, what="producer store empty")
    wait_for(
        lambda: ray.get(p.__ray_call__.remote(_registrations)) == (0, 0),
        what="NIXL registrations released",
    )
    ray.kill(p)
    ray.kill(c)


def test_one_storage_registered_once_and_kept_while_used(ray_session):
    p, c = patched(actors.Producer.remote()), patched(actors.Consumer.remote())
    first, second = ray.get(p.__ray_call__.remote(_put_kept_twice))
    # Two objects, one storage, one registration (made on the preparation thread).
    wait_for(
        lambda: ray.get(p.__ray_call__.remote(_registrations)) == (1, (1 << 16) * 4),
        what="one registration for both objects",
    )
    del first
    wait_for(lambda: ray.get(p.stats.remote()).num_objects == 1, what="first object freed")
    assert ray.get(p.__ray_call__.remote(_registrations)) == (1, (1 << 16) * 4)
    got = ray.get(c.get_with_rd.remote([second]))[0]
    assert torch.equal(got["y"], torch.arange(10, 20, dtype=torch.float32))
    del second
    wait_for(lambda: ray.get(p.__ray_call__.remote(_registrations)) == (0, 0), what="released")
    ray.kill(p)
    ray.kill(c)


def test_reused_addresses_read_fresh_data(ray_session):
    """Free and re-export buffers of one size many times: the consumer never reads
    through a stale registration of an address that was registered again."""
    p, c = patched(actors.Producer.remote()), patched(actors.Consumer.remote())
    for fill in range(1, 7):
        [ref] = ray.get(p.__ray_call__.remote(_put_full, 4 * MiB, fill))
        assert ray.get(c.summarize.remote(ref))[1] == fill
        del ref
        wait_for(lambda: ray.get(p.stats.remote()).num_objects == 0, what="freed")
    ray.kill(p)
    ray.kill(c)


def test_killed_producer_gives_producer_lost_in_bounded_time(ray_session):
    p = NixlProducer.remote()
    c = patched(actors.Producer.remote())
    warm, ref = p.value.remote("dtypes"), p.value.remote("views")
    assert ray.get(c.check.remote("dtypes", warm)) is None  # the consumer knows the agent
    os.kill(ray.get(p.pid.remote()), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(rd.ProducerLostError, match="Re-run the producer"):
        rd.get(ref, timeout=60, tensor_transport="nixl")
    assert time.monotonic() - start < 15
    start = time.monotonic()
    message = ray.get(c.try_get.remote([ref], 60, "nixl"), timeout=90)
    assert message.startswith("ProducerLostError"), message
    assert time.monotonic() - start < 15
    ray.kill(c)


def test_method_declared_nixl(ray_session):
    p, c = NixlProducer.remote(), patched(actors.Consumer.remote())
    ref = p.value.remote("aliasing")
    assert ray.get(c.check.remote("aliasing", ref)) is None
    assert actors.check_value("aliasing", ray.get(ref)) is None
    ray.kill(p)
    ray.kill(c)


def _export_arena(self: Any, fill: int) -> list[ray.ObjectRef]:
    """An object over memory the actor keeps: freeing the object leaves it mapped."""
    if not hasattr(self, "arena"):
        self.arena = torch.zeros(1 * MiB, dtype=torch.uint8)
    self.arena.fill_(fill)
    return [rd.put(self.arena, tensor_transport="nixl")]


def _free_everything(_self: Any) -> None:
    from raydirect._store import store

    store.clear()


def test_a_read_of_a_freed_object_raises_never_another_objects_bytes(ray_session):
    """A reader that fetched an object's metadata reads on after the producer freed
    the object and gave its memory to another: NIXL still reads the memory through
    the dropped registration (UCX checks nothing), so the read must fail on the
    object's seal, not return the other object's bytes (it did, sevens)."""
    p = patched(actors.Producer.remote())
    [ref] = ray.get(p.__ray_call__.remote(_export_arena, 3))
    [pending] = get_deferred([ref])
    assert bool((fetch_value(pending.payload, forced="nixl") == 3).all())  # metadata kept
    ray.get(p.__ray_call__.remote(_free_everything))
    [other] = ray.get(p.__ray_call__.remote(_export_arena, 7))  # the same memory, sevens
    with pytest.raises(rd.ProducerLostError, match="freed the object"):
        fetch_value(pending.payload, forced="nixl")
    assert bool((rd.get(other, timeout=60, tensor_transport="nixl") == 7).all())
    ray.kill(p)


def _export_unkept(_self: Any, nbytes: int, fill: int) -> list[ray.ObjectRef]:
    """An object whose tensor only the object keeps: at 64 MiB, beyond malloc's
    largest mmap threshold (32 MiB), its free unmaps the memory."""
    return [rd.put(torch.full((nbytes,), fill, dtype=torch.uint8), tensor_transport="nixl")]


def test_a_read_of_an_object_freed_and_unmapped_says_freed_not_disconnected(ray_session):
    """UCX drops the connection when a READ finds the producer's memory unmapped;
    the producer lives, so the read asks the seal again on a new connection and
    says the object was freed (it said "disconnected"), and the next read works."""
    p = patched(actors.Producer.remote())
    [ref] = ray.get(p.__ray_call__.remote(_export_unkept, 64 * MiB, 3))
    [pending] = get_deferred([ref])
    assert bool((fetch_value(pending.payload, forced="nixl") == 3).all())  # metadata kept
    ray.get(p.__ray_call__.remote(_free_everything))
    with pytest.raises(rd.ProducerLostError, match="freed the object"):
        fetch_value(pending.payload, forced="nixl")
    [other] = ray.get(p.__ray_call__.remote(_export_unkept, 64 * MiB, 7))
    assert bool((rd.get(other, timeout=60, tensor_transport="nixl") == 7).all())
    ray.kill(p)


@ray.remote(num_cpus=0)
class NixlStage:
    @rd.method(reads=1, tensor_transport="nixl")
    def once(self, fill: int) -> torch.Tensor:
        return torch.full((1 << 18,), fill, dtype=torch.int32)  # 1 MiB

    def held(self) -> int:
        return rd.local_stats().num_objects


def test_an_object_read_once_over_nixl_is_freed_by_its_read(ray_session):
    """reads=1 over nixl (an auto one, read across nodes, in tests/multinode): the
    read's notice frees it; a later read names the lifetime."""
    p = NixlStage.remote()
    ref = p.once.remote(5)
    got = rd.get(ref, timeout=60, tensor_transport="nixl")
    assert bool((got == 5).all()) and got.numel() == 1 << 18
    assert rd.local_stats().objects_received.get("nixl", 0) >= 1
    wait_for(lambda: ray.get(p.held.remote()) == 0, what="freed by its one read")
    with pytest.raises(rd.ProducerLostError, match=r"reads=1"):
        rd.get(ref, timeout=60, tensor_transport="nixl")
    ray.kill(p)
