"""Collective groups and the two-sided transports, over real Gloo groups."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import ray
import torch

import raydirect as rd

from actors import Producer, check_value
from helpers import wait_for


def received(actor, transport: str) -> int:
    return ray.get(actor.stats.remote()).objects_received.get(transport, 0)


@pytest.fixture(scope="module")
def trio(ray_session):
    a, b, c = Producer.remote(), Producer.remote(), Producer.remote()
    name = rd.create_collective_group([a, b], backend="gloo", name="ab")
    assert name == "ab"
    yield a, b, c
    for actor in (a, b, c):
        ray.kill(actor)
    for leftover in ("ab", "bc"):
        with contextlib.suppress(ValueError):
            rd.destroy_collective_group(leftover)


def test_gloo_between_members(trio):
    a, b, _ = trio
    before = received(b, "gloo")
    for case in ("dtypes", "views", "aliasing", "numpy", "params"):
        assert ray.get(b.check.remote(case, a.value_gloo.remote(case))) is None
    assert received(b, "gloo") == before + 5


def test_put_inside_a_member(trio):
    a, b, _ = trio
    [ref] = ray.get(a.put.remote("dtypes", "gloo"))
    before = received(b, "gloo")
    assert ray.get(b.check.remote("dtypes", ref)) is None
    assert received(b, "gloo") == before + 1


def test_driver_and_non_member_fall_back_to_tcp(trio):
    a, _, c = trio
    ref = a.value_gloo.remote("aliasing")
    assert check_value("aliasing", ray.get(ref)) is None
    before = received(c, "tcp")
    assert ray.get(c.check.remote("aliasing", ref)) is None
    assert received(c, "tcp") == before + 1


def test_ref_forwarded_by_a_non_member_to_a_member(trio):
    a, b, c = trio
    before = received(b, "gloo")
    assert ray.get(c.forward.remote(b, "views", [a.value_gloo.remote("views")])) is None
    assert received(b, "gloo") == before + 1


def test_several_refs_at_once(trio):
    a, b, _ = trio
    refs = [a.value_gloo.remote("dtypes") for _ in range(4)]
    before = received(b, "gloo")
    values = ray.get(b.get_with_rd.remote(refs, 60))
    assert [check_value("dtypes", v) for v in values] == [None] * 4
    assert ray.get(b.check_many.remote("dtypes", *refs)) == [None] * 4
    assert received(b, "gloo") == before + 8


def test_actor_in_two_groups(trio):
    a, b, c = trio
    rd.create_collective_group([b, c], backend="gloo", name="bc")
    try:
        # b is in ab and bc: c reads b's objects over bc, b reads a's over ab.
        before_c, before_b = received(c, "gloo"), received(b, "gloo")
        assert ray.get(c.check.remote("dtypes", b.value_gloo.remote("dtypes"))) is None
        assert ray.get(b.check.remote("views", a.value_gloo.remote("views"))) is None
        assert received(c, "gloo") == before_c + 1 and received(b, "gloo") == before_b + 1
    finally:
        rd.destroy_collective_group("bc")


def test_bad_input_is_refused_with_the_fix(trio):
    a, b, c = trio
    with pytest.raises(ray.exceptions.RayTaskError, match="create_collective_group"):
        ray.get(c.value_gloo.remote("dtypes"))  # c is in no gloo group
    with pytest.raises(ray.exceptions.RayTaskError, match="moves only cpu"):
        ray.get(a.meta_tensor.remote())
    message = ray.get(c.try_get.remote([a.value_gloo.remote("dtypes")], 30, "gloo"))
    assert message.startswith("GroupError") and "rd.create_collective_group" in message
    with pytest.raises(ValueError, match="unknown collective backend"):
        rd.create_collective_group([a, b], backend="mpi")
    with pytest.raises(ValueError, match="exists; destroy it first"):
        rd.create_collective_group([a, c], backend="gloo", name="ab")
    with pytest.raises(ValueError, match="one or more actor handles"):
        rd.create_collective_group([], backend="gloo")
    with pytest.raises(ValueError, match="one or more actor handles"):
        rd.create_collective_group([a, "not an actor"], backend="gloo")


def test_application_error_leaves_the_group_intact(trio):
    a, b, _ = trio
    with pytest.raises(ray.exceptions.RayTaskError, match="application error"):
        ray.get(a.fails.remote())
    assert ray.get(b.check.remote("dtypes", a.value_gloo.remote("dtypes"))) is None


def test_destroy_then_recreate(ray_session):
    a, b = Producer.remote(), Producer.remote()
    rd.create_collective_group([a, b], backend="gloo", name="again")
    old = a.value_gloo.remote("dtypes")
    assert ray.get(b.check.remote("dtypes", old)) is None
    rd.destroy_collective_group([a, b])
    with pytest.raises(ray.exceptions.RayTaskError, match="create_collective_group"):
        ray.get(a.value_gloo.remote("dtypes"))
    # An object of the destroyed group is still readable, over tcp.
    before = received(b, "tcp")
    assert ray.get(b.check.remote("dtypes", old)) is None
    assert received(b, "tcp") == before + 1
    rd.create_collective_group([a, b], backend="gloo", name="again")
    before = received(b, "gloo")
    assert ray.get(b.check.remote("dtypes", a.value_gloo.remote("dtypes"))) is None
    assert received(b, "gloo") == before + 1
    rd.destroy_collective_group("again")
    ray.kill(a)
    ray.kill(b)


def test_failed_transfer_marks_the_group_broken_everywhere(ray_session):
    a, b = Producer.remote(), Producer.remote()
    rd.create_collective_group([a, b], backend="gloo", name="fragile")
    small = a.value_gloo.remote("dtypes")
    ray.get(b.get_with_rd.remote([small], 30))
    big = a.big_gloo.remote(512 << 20)
    ray.wait([big])
    # A deadline that falls inside the transfer: one that passes before it starts
    # leaves the group intact (a FetchTimeoutError), so try longer ones until one lands.
    deadline, message = 0.01, ""
    for _ in range(30):
        message = ray.get(b.try_get.remote([big], deadline))
        if "GroupError" in message:
            break
        assert "FetchTimeoutError" in message, message  # not read whole yet
        deadline *= 1.3
    assert "GroupError" in message, f"no deadline up to {deadline:.2f}s fell inside the transfer"
    # Both members now refuse, naming the group and the fix.
    later = ray.get(b.try_get.remote([small], 30))
    assert "'fragile' is broken" in later and "create it again" in later
    # The producer learns it from the consumer's message to its agent.
    wait_for(lambda: "'fragile' is broken" in _export_error(a), what="producer told")
    rd.destroy_collective_group("fragile")
    rd.create_collective_group([a, b], backend="gloo", name="fragile")
    assert ray.get(b.check.remote("dtypes", a.value_gloo.remote("dtypes"))) is None
    rd.destroy_collective_group("fragile")
    ray.kill(a)
    ray.kill(b)


def _export_error(actor) -> str:
    try:
        ray.get(actor.value_gloo.remote("dtypes"))
    except ray.exceptions.RayTaskError as exc:
        return str(exc)
    return ""


def test_killed_member_fails_in_bounded_time(ray_session):
    a, b = Producer.remote(), Producer.remote()
    rd.create_collective_group([a, b], backend="gloo", name="mortal")
    ref = a.value_gloo.remote("dtypes")
    ray.wait([ref])
    os.kill(ray.get(a.pid.remote()), signal.SIGKILL)
    start = time.monotonic()
    message = ray.get(b.try_get.remote([ref]), timeout=120)
    assert message.startswith("ProducerLostError") and "Re-run the producer" in message
    assert time.monotonic() - start < 30
    rd.destroy_collective_group("mortal")  # a dead member is skipped
    ray.kill(b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU; none here")
def test_nccl_between_members(ray_session):
    gpu = Producer.options(num_gpus=0.5)
    a, b = gpu.remote(), gpu.remote()
    rd.create_collective_group([a, b], backend="nccl", name="nccl")
    [ref] = ray.get(
        a.__ray_call__.remote(lambda self: [rd.put(torch.ones(1024, device="cuda"), "nccl")])
    )
    got = ray.get(b.__ray_call__.remote(lambda self, refs: float(ray.get(refs[0]).sum()), [ref]))
    assert got == 1024.0
    assert ray.get(b.stats.remote()).objects_received.get("nccl") == 1
    rd.destroy_collective_group("nccl")


def test_member_killed_during_a_transfer(ray_session):
    a, b = Producer.remote(), Producer.remote()
    rd.create_collective_group([a, b], backend="gloo", name="midway")
    big = a.big_gloo.remote(512 << 20)
    ray.wait([big])
    pid = ray.get(a.pid.remote())
    start = time.monotonic()
    pending = b.try_get.remote([big])
    os.kill(pid, signal.SIGKILL)  # before or while the bytes move: both must end cleanly
    message = ray.get(pending, timeout=120)
    assert message.split(":")[0] in ("ProducerLostError", "GroupError"), message
    assert time.monotonic() - start < 60
    # The survivor stays usable for everything else.
    assert ray.get(b.check.remote("dtypes", b.value.remote("dtypes"))) is None
    rd.destroy_collective_group("midway")
    ray.kill(b)
