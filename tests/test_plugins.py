"""Plug-in transports: registered at any time, from any process, surviving restarts."""

from __future__ import annotations

import contextlib
import os
import signal

import numpy as np
import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd
from raydirect import testing

import plugin_transports
from actors import Producer, check_value
from helpers import wait_for
from plugin_transports import (
    AbortableBrokenTransport,
    BrokenRecvTransport,
    FailingPrepareTransport,
    GatedPrepareTransport,
    LyingDeviceTransport,
    NotATransport,
    NumpyShmTransport,
    PickleShmTransport,
    plugin_files,
)

# The task below refers to these classes: ship them to workers by value.
cloudpickle.register_pickle_by_value(plugin_transports)


def received(actor, transport: str) -> int:
    return ray.get(actor.stats.remote()).objects_received.get(transport, 0)


@pytest.fixture(scope="module")
def actors_first(ray_session):
    """Actors created before any plug-in is registered."""
    p, c = Producer.remote(), Producer.remote()
    ray.get([p.pid.remote(), c.pid.remote()])
    rd.register_tensor_transport("pickle_shm", ["cpu"], PickleShmTransport, replace=True)
    yield p, c
    ray.kill(p)
    ray.kill(c)


def test_registered_after_the_actors_exist(actors_first):
    p, c = actors_first
    before = plugin_files()
    ref = p.value_plugin.remote("dtypes")
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert received(c, "pickle_shm") == 1
    assert check_value("dtypes", ray.get(ref)) is None  # the driver uses it too
    [put_ref] = ray.get(p.put.remote("views", "pickle_shm"))
    assert ray.get(c.check.remote("views", put_ref)) is None
    assert len(plugin_files() - before) == 2
    del ref, put_ref  # garbage_collect runs in the producer and removes the files
    wait_for(lambda: not (plugin_files() - before), what="plug-in files removed")


def test_a_borrowed_handle_can_use_it(actors_first):
    p, c = actors_first

    @ray.remote(num_cpus=0)
    def submit(producer, consumer):
        return ray.get(consumer.check.remote("aliasing", producer.value_plugin.remote("aliasing")))

    assert ray.get(submit.remote(p, c)) is None


def test_named_before_it_is_registered(actors_first):
    p, c = actors_first
    with pytest.raises(
        ray.exceptions.RayTaskError, match="unknown tensor transport 'registered_late'"
    ):
        ray.get(p.value_late.remote("dtypes"))

    @ray.remote(num_cpus=0)
    def register_elsewhere():  # not the driver, not the actors' creator
        rd.register_tensor_transport("registered_late", ["cpu"], PickleShmTransport, replace=True)

    ray.get(register_elsewhere.remote())
    assert ray.get(c.check.remote("dtypes", p.value_late.remote("dtypes"))) is None
    assert received(c, "registered_late") == 1


def test_survives_a_producer_restart(ray_session):
    rd.register_tensor_transport("pickle_shm", ["cpu"], PickleShmTransport, replace=True)
    p = Producer.options(max_restarts=1).remote()
    c = Producer.remote()
    assert ray.get(c.check.remote("dtypes", p.value_plugin.remote("dtypes"))) is None
    old = ray.get(p.pid.remote())
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: _pid(p) not in (None, old), timeout=60, what="restart")
    assert ray.get(c.check.remote("views", p.value_plugin.remote("views"))) is None
    ray.kill(p)
    ray.kill(c)


def _pid(actor):
    try:
        return ray.get(actor.pid.remote(), timeout=5)
    except Exception:
        return None


def test_numpy_typed_transport(actors_first):
    p, c = actors_first
    rd.register_tensor_transport("numpy_shm", ["cpu"], NumpyShmTransport, np.ndarray, replace=True)
    [ref] = ray.get(p.put.remote("numpy", "numpy_shm"))
    assert ray.get(c.check.remote("numpy", ref)) is None  # arrays and the torch tensor
    assert received(c, "numpy_shm") == 1
    got = ray.get(ref)
    assert isinstance(got["arr"], np.ndarray) and isinstance(got["tensor"], torch.Tensor)


def test_bad_registrations_are_refused_and_leave_nothing(ray_session):
    with pytest.raises(TypeError, match="subclass of rd.TensorTransportManager"):
        rd.register_tensor_transport("bad", ["cpu"], NotATransport)
    with pytest.raises(ValueError, match="built-ins"):
        rd.register_tensor_transport("tcp", ["cpu"], PickleShmTransport)
    with pytest.raises(ValueError, match="devices"):
        rd.register_tensor_transport("bad", "cpu", PickleShmTransport)
    with pytest.raises(TypeError, match="data_type"):
        rd.register_tensor_transport("bad", ["cpu"], PickleShmTransport, list)
    assert "bad" not in rd.put.__globals__["check_name"].__globals__["known_names"]()
    rd.register_tensor_transport("taken", ["cpu"], PickleShmTransport, replace=True)
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        rd.register_tensor_transport("taken", ["cpu"], PickleShmTransport)
    rd.register_tensor_transport("taken", ["cpu"], NumpyShmTransport, replace=True)


def test_a_failing_receive_is_reported_and_both_actors_stay_usable(actors_first):
    p, c = actors_first
    rd.register_tensor_transport("broken", ["cpu"], BrokenRecvTransport, replace=True)
    [ref] = ray.get(p.put.remote("dtypes", "broken"))
    message = ray.get(c.try_get.remote([ref]))
    assert message.startswith("TransferError") and "'broken'" in message
    assert "the disk is on fire" in message
    assert ray.get(c.check.remote("dtypes", p.value_plugin.remote("dtypes"))) is None
    assert ray.get(c.check.remote("views", p.value.remote("views"))) is None


def test_abort_runs_on_both_sides(actors_first):
    p, c = actors_first
    rd.register_tensor_transport("abortable", ["cpu"], AbortableBrokenTransport, replace=True)
    [ref] = ray.get(p.put.remote("dtypes", "abortable"))
    assert ray.get(c.try_get.remote([ref])).startswith("TransferError")
    pids = {ray.get(p.pid.remote()), ray.get(c.pid.remote())}

    def aborted_in() -> set[int]:
        return {int(n.rsplit("-", 1)[1]) for n in plugin_files() if n.startswith("rdplug-abort-")}

    wait_for(lambda: pids <= aborted_in(), what="abort_transport in producer and consumer")
    for name in [n for n in plugin_files() if n.startswith("rdplug-abort-")]:
        os.unlink(f"/dev/shm/{name}")


def test_entry_point_transports_are_found(tmp_path, monkeypatch):
    from raydirect.transports import registry

    (tmp_path / "rdfake_transport.py").write_text(
        "from plugin_transports import PickleShmTransport\n"
        "class FakeTransport(PickleShmTransport):\n"
        "    devices = ('cpu',)\n"
    )
    dist = tmp_path / "rdfake-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rdfake\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[raydirect.transports]\nrdfake = rdfake_transport:FakeTransport\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "rdfake" in registry.known_names()
    assert registry.transport_class("rdfake").__name__ == "FakeTransport"


def test_slow_preparation_never_delays_the_producer(actors_first):
    p, c = actors_first
    rd.register_tensor_transport("gated", ["cpu"], GatedPrepareTransport, replace=True)
    gate = GatedPrepareTransport.GATE
    if os.path.exists(gate):
        os.unlink(gate)
    try:
        ref = p.value_gated.remote("dtypes")
        # The gate is closed, so preparation cannot finish: the method and the
        # actor's next call complete regardless.
        assert ray.wait([ref], timeout=60)[0] == [ref]
        assert ray.get(p.pid.remote(), timeout=60) > 0
        reading = c.check.remote("dtypes", ref)
        assert ray.wait([reading], timeout=1)[0] == []  # the consumer waits for it
        open(gate, "w").close()
        assert ray.get(reading, timeout=60) is None
    finally:
        if os.path.exists(gate):
            os.unlink(gate)


def test_a_failed_background_preparation_reaches_the_consumer(actors_first):
    p, c = actors_first
    rd.register_tensor_transport("failing_prepare", ["cpu"], FailingPrepareTransport, replace=True)
    ref = p.value_failing_prepare.remote("dtypes")
    error = ray.get(c.try_get.remote([ref]))
    assert "preparing it for failing_prepare failed" in error
    assert "no space left for the staging copy" in error
    assert ray.get(p.pid.remote()) > 0


def test_metadata_on_a_device_the_registration_lacks_is_refused_before_receiving(actors_first):
    """Ray's test_async_metadata_extraction_validates_tensor_device: registered for
    cpu, the plug-in's metadata says cuda. The receive would succeed; the check
    above the plug-in refuses first, naming the device and the registration."""
    p, c = actors_first
    rd.register_tensor_transport("lying", ["cpu"], LyingDeviceTransport, np.ndarray, replace=True)
    [ref] = ray.get(p.put.remote("numpy", "lying"))
    message = ray.get(c.try_get.remote([ref]))
    assert message.startswith("TransferError"), message
    assert "tensor_device='cuda'" in message and "does not support 'cuda'" in message
    assert "registered for cpu (rd.register_tensor_transport('lying', ['cpu'], ...))" in message
    with pytest.raises(ray.exceptions.RaySystemError, match="does not support"):
        ray.get(ref)  # the driver, as in Ray's test
    assert received(c, "lying") == 0
    # Registered for cuda too, the metadata still disagrees with the cpu tensors.
    rd.register_tensor_transport("lying2", ["cpu", "cuda"], LyingDeviceTransport, replace=True)
    [ref] = ray.get(p.put.remote("dtypes", "lying2"))
    message = ray.get(c.try_get.remote([ref]))
    assert message.startswith("TransferError") and "the object's tensors are on cpu" in message
    assert received(c, "lying2") == 0
    assert ray.get(c.check.remote("dtypes", p.value_plugin.remote("dtypes"))) is None


# ---------------------------------------------------------------- two-sided


class _RecvFails(plugin_transports.GlooPlugin):
    def recv_multiple_tensors(self, obj_id, meta, comm, target_buffers=None):
        raise RuntimeError("the receive side is on fire")


@pytest.fixture()
def gloo_pair(actors_first):
    p, c = actors_first
    name = rd.create_collective_group([p, c], backend="gloo")
    yield p, c
    rd.destroy_collective_group(name)


def _sent(actor, transport: str) -> int:
    return ray.get(actor.stats.remote()).objects_sent.get(transport, 0)


def test_a_two_sided_plugin_registered_after_the_actors_exist(gloo_pair):
    """The send runs in the producer, once per read; the driver falls back; GC
    reaches garbage_collect."""
    p, c = gloo_pair
    rd.register_tensor_transport("gloo_plugin", ["cpu"], plugin_transports.GlooPlugin, replace=True)
    [ref] = ray.get(p.put.remote("dtypes", "gloo_plugin"))
    for reads in (1, 2):
        assert ray.get(c.check.remote("dtypes", ref)) is None
        assert received(c, "gloo_plugin") == reads and _sent(p, "gloo_plugin") == reads
    assert check_value("dtypes", rd.get(ref, timeout=60)) is None  # over tcp: not in the group
    assert _sent(p, "gloo_plugin") == 2
    gc_files = {f for f in plugin_files() if f.startswith("rdplug-gc-")}
    del ref
    wait_for(
        lambda: {f for f in plugin_files() if f.startswith("rdplug-gc-")} - gc_files,
        what="garbage_collect in the producer",
    )


def test_a_send_still_running_when_its_object_is_freed_is_aborted(ray_session):
    """A consumer killed in the middle of a two-sided receive sends no abort: once
    the last ref is gone, the free aborts the producer's send, which would
    otherwise hang until the plug-in's own timeout, holding a plug-in lane."""
    cloudpickle.register_pickle_by_value(plugin_transports)
    p, c = testing.Member.remote(), testing.Member.remote()
    group = rd.create_collective_group([p, c], backend="gloo")
    name = "gloo_plugin-hang-freed"
    hanging = testing.failing(plugin_transports.GlooPlugin, "hang")
    rd.register_tensor_transport(name, ["cpu"], hanging, replace=True)

    def running() -> int:
        return ray.get(p.__ray_call__.remote(plugin_transports.sends_running), timeout=30)

    try:
        [ref] = ray.get(p.put.remote("dtypes", name, torch.Tensor))
        c.read_error.remote([ref], None)  # no deadline: it waits in its receive
        wait_for(lambda: running() == 1, what="the producer's send running")
        ray.kill(c)  # gone without a word: no abort comes from it
        del ref
        wait_for(lambda: ray.get(p.aborts.remote()) == 1, what="the send aborted by the free")
        assert running() == 0
    finally:
        ray.kill(p)
        ray.kill(c)
        with contextlib.suppress(Exception):
            rd.destroy_collective_group(group)


def test_a_two_sided_receive_that_fails_names_the_transport(gloo_pair):
    p, c = gloo_pair
    rd.register_tensor_transport("gloo_recv_fails", ["cpu"], _RecvFails, replace=True)
    [ref] = ray.get(p.put.remote("dtypes", "gloo_recv_fails"))
    error = ray.get(c.try_get.remote([ref], 60))
    assert error.startswith("TransferError") and "gloo_recv_fails" in error, error
    assert "on fire" in error
    # Both actors still serve and read (another object, the same pair).
    [ok] = ray.get(p.put.remote("views", "tcp"))
    assert ray.get(c.check.remote("views", ok)) is None
