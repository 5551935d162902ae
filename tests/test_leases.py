"""Leases: minted in an actor by a task it sends itself (memory store, no plasma),
``ray.put`` where none is ready. The lifetimes themselves (pending, borrowed,
nested, through other processes, the producer's death) are tests/test_lifetime.py's,
which run with these leases."""

from __future__ import annotations

import ray
import torch

import raydirect as rd
from raydirect import _lease
from raydirect._lease import _MINTED

from helpers import wait_for

NUMEL = 1 << 16  # 256 KiB of float32: a direct object, not inline


@ray.remote
class Minter:
    def ready(self) -> int:
        _lease.leases._start_refill()
        return len(_lease.leases._ready)

    def where(self) -> list[list[str]]:
        """The nodes holding the next ready lease, and a ray.put one, in plasma
        (none: the memory store)."""
        minted, put = _lease.leases._ready[0], ray.put(b"")
        found = ray.experimental.get_object_locations([minted, put])
        return [sorted(found[minted]["node_ids"]), sorted(found[put]["node_ids"])]

    @rd.method
    def value(self, n: int) -> torch.Tensor:
        return torch.full((NUMEL,), float(n))

    def many(self, n: int) -> tuple[list, int]:
        """``n`` direct values made in one method, each taking a lease. This
        single-threaded actor is busy meanwhile, so the self-call that would mint
        more waits behind it: once the ready ones are gone, leases are ray.put."""
        made, fewest = [], len(_lease.leases._ready)
        for i in range(n):
            made.append(self.value(i))
            fewest = min(fewest, len(_lease.leases._ready))
        return made, fewest

    def held(self) -> int:
        return rd.local_stats().num_objects


def test_an_actor_mints_its_leases_in_its_memory_store(ray_session):
    """If a Ray upgrade drops ``__ray_call__`` or moves small task returns to
    plasma, this fails: leases would silently go back to ray.put."""
    minter = Minter.remote()
    wait_for(lambda: ray.get(minter.ready.remote()) >= _MINTED, what="leases minted")
    minted, put = ray.get(minter.where.remote())
    assert put, "a ray.put lease is a plasma object (has Ray changed?)"
    assert minted == [], f"the minted lease is a plasma object on {minted}"
    ray.kill(minter)


def test_leases_by_ray_put_while_a_long_method_holds_the_actor(ray_session):
    minter = Minter.remote()
    ready = wait_for(lambda: ray.get(minter.ready.remote()) >= _MINTED, what="leases minted")
    ref = minter.many.remote(3 * _MINTED)  # its leases live as long as this ref
    values, fewest = ray.get(ref, timeout=120)
    assert fewest == 0, f"the pool never ran dry ({ready} ready, {fewest} at the fewest)"
    assert [int(v[0]) for v in values] == list(range(3 * _MINTED))
    assert all(v.shape == (NUMEL,) and bool((v == v[0]).all()) for v in values)
    assert ray.get(minter.held.remote()) == 3 * _MINTED
    del ref
    wait_for(lambda: ray.get(minter.held.remote()) == 0, what="every object freed by its lease")
    ray.kill(minter)
