"""The trainer's mailbox under load, on a real Ray: writers are never held behind
waiters (256 waiting workers, as many as 32 engines of tensor parallel 8), every
waiter wakes on the write it waits for, and a rank's failure reaches every
waiting rank at once, not at its deadline. Light actors stand for the workers:
no engine is needed to wait on a mailbox."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import cloudpickle

from raydirect.vllm.mailbox import RaydirectMailbox
from raydirect.vllm.trainer import _mailbox_at_rank0

from helpers import wait_for

# The light actors go by value: importing this module would import vLLM in each.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
WORKERS = 256
LONG = 300.0  # a waiter's own deadline: far beyond what any write may take
SOON = 30.0  # what a write may take, on a loaded 2-core machine


@ray.remote(num_cpus=0)
class Workers:
    """Many engine workers' waits from one light process."""

    def __init__(self, name: str) -> None:
        self.box = ray.get_actor(name)

    async def take(self, version: int, n: int) -> list[Any]:
        return await asyncio.gather(*[self.box.take.remote(version, LONG) for _ in range(n)])

    async def outcome(self, version: int, n: int) -> list[str]:
        return await asyncio.gather(*[self.box.outcome.remote(version, LONG) for _ in range(n)])


@pytest.fixture(scope="module")
def mailbox(ray_session: None) -> Iterator[tuple[Any, list[Any]]]:
    """A mailbox of two ranks, and two light actors waiting on it."""
    box = RaydirectMailbox.options(name="mailbox-under-load").remote(2)  # type: ignore[attr-defined]
    groups = [Workers.remote("mailbox-under-load") for _ in range(2)]
    ray.get([box.ranks.remote(), *[g.__ray_ready__.remote() for g in groups]])
    yield box, groups
    for actor in (box, *groups):
        ray.kill(actor)


def _waiting(box: Any, n: int) -> None:
    wait_for(lambda: ray.get(box.waiting.remote()) >= n, timeout=120, what=f"{n} waiters")


def test_writers_pass_256_waiting_workers(mailbox: tuple[Any, list[Any]]) -> None:
    mailbox, groups = mailbox
    ray.get(mailbox.put.remote(1, 0, ["rank 0's handle"]), timeout=SOON)
    taken = [g.take.remote(1, WORKERS // len(groups)) for g in groups]
    _waiting(mailbox, WORKERS)
    # Every write goes through while all of them wait (they would hold every slot
    # of a mailbox whose waits took slots, and the write would wait LONG).
    for worker in range(WORKERS):
        ray.get(mailbox.join.remote(1, f"w{worker}", {"label": f"w{worker}"}), timeout=SOON)
    ray.get(mailbox.put.remote(1, 1, ["rank 1's handle"]), timeout=SOON)
    got = [h for hs in ray.get(taken, timeout=SOON) for h in hs]
    assert got == [["rank 0's handle", "rank 1's handle"]] * WORKERS
    reports = mailbox.reports.remote(1, "received", LONG)
    for worker in range(WORKERS):
        mailbox.report.remote(1, f"w{worker}", "received", "")
    said = ray.get(reports, timeout=SOON)
    assert len(said["workers"]) == len(said["said"]) == WORKERS


def test_a_rank_that_cannot_publish_is_known_at_once(mailbox: tuple[Any, list[Any]]) -> None:
    """Rank 0 fails: the ranks waiting for the outcome and the workers waiting
    for the handles learn it from that write, not at their deadline."""
    mailbox, groups = mailbox
    ray.get(mailbox.put.remote(3, 1, ["rank 1's handle"]), timeout=SOON)
    outcomes = groups[0].outcome.remote(3, 8)
    taken = groups[1].take.remote(3, 8)
    _waiting(mailbox, 16)
    ray.get(mailbox.fail.remote(3, 0, "its source raised"), timeout=SOON)
    said = ray.get(outcomes, timeout=SOON)
    assert all("rank 0 could not publish version 3: its source raised" in s for s in said)
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 0 could not publish"):
        ray.get(taken, timeout=SOON)


def test_a_trainer_made_again_under_its_name_replaces_its_mailbox(ray_session: None) -> None:
    """trainer_init kills the mailbox an earlier trainer of its name left, and
    makes its own: ray.kill returns before Ray lets the name go, and the new one
    made at once failed now and then with ActorAlreadyExistsError (seen in CI)."""
    name = "mailbox-made-again"
    boxes = []
    for _ in range(3):  # each a new process importing vLLM: about 6 s here
        boxes.append(_mailbox_at_rank0(name, 1, LONG))
        assert ray.get(boxes[-1].ranks.remote(), timeout=SOON) == 1
    assert ray.get_actor(name)._actor_id == boxes[-1]._actor_id
    ray.kill(boxes[-1])


def test_an_update_is_under_way_from_its_first_handle_to_its_end(ray_session: None) -> None:
    """What an engine's init asks before another trainer takes the engine: the
    version under way from rank 0's first handle to its ``done`` (after its last
    call to the engines), none once it ended or failed, and none once it is older
    than the trainer's timeout (its trainer stopped in the middle)."""
    box = RaydirectMailbox.remote(1, 5.0)  # type: ignore[attr-defined]
    try:
        assert ray.get(box.updating.remote(), timeout=SOON) == 0
        ray.get(box.put.remote(1, 0, ["handle"]), timeout=SOON)
        ray.get(box.decide.remote(1, True), timeout=SOON)  # decided, not yet finished
        assert ray.get(box.updating.remote(), timeout=SOON) == 1
        ray.get(box.done.remote(1, ""), timeout=SOON)
        assert ray.get(box.updating.remote(), timeout=SOON) == 0
        ray.get(box.put.remote(2, 0, ["handle"]), timeout=SOON)
        ray.get(box.decide.remote(2, False), timeout=SOON)  # an abort still closes sessions
        assert ray.get(box.updating.remote(), timeout=SOON) == 2
        ray.get(box.fail.remote(2, 0, "its source raised"), timeout=SOON)
        assert ray.get(box.updating.remote(), timeout=SOON) == 0
        ray.get(box.put.remote(3, 0, ["handle"]), timeout=SOON)  # and never ended
        assert ray.get(box.updating.remote(), timeout=SOON) == 3
        wait_for(lambda: ray.get(box.updating.remote()) == 0, timeout=30, what="the timeout")
    finally:
        ray.kill(box)
