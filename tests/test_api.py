"""The public API: decorator forms, actor kinds, put from anywhere, get, stats, errors."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time

import pytest
import ray
import torch

import raydirect as rd

from actors import (
    AsyncConsumer,
    AsyncProducer,
    Consumer,
    ThreadedProducer,
    check_value,
    make_value,
    task_check,
    task_put,
)
from helpers import wait_for


def test_public_names():
    assert sorted(rd.__all__) == sorted(
        [
            "CommunicatorMetadata",
            "FetchRequest",
            "FetchTimeoutError",
            "GroupError",
            "LocalStats",
            "WeightPublisher",
            "WeightSubscriber",
            "WeightSyncError",
            "WeightsHandle",
            "ProducerLostError",
            "RaydirectError",
            "Region",
            "RegionHandle",
            "TensorTransportManager",
            "TensorTransportMetadata",
            "TransferError",
            "TransportUnavailableError",
            "UnknownTransportError",
            "broadcast",
            "cluster_secret",
            "create_collective_group",
            "destroy_collective_group",
            "export_region",
            "get",
            "get_async",
            "init_ray",
            "local_stats",
            "method",
            "notify_region",
            "put",
            "read_ranges",
            "read_ranges_async",
            "register_tensor_transport",
            "set_target",
            "wait_tensor_freed",
        ]
    )
    for name in rd.__all__:
        assert hasattr(rd, name)


def test_num_returns_stacked_below_and_above(pair):
    p, c = pair
    a, b = p.two_below.remote()
    assert torch.equal(ray.get(a), torch.ones(3)) and torch.equal(ray.get(b), torch.zeros(4))
    a, b = p.two_above.remote()
    assert torch.equal(ray.get(a), torch.ones(5)) and torch.equal(ray.get(b), torch.zeros(6))


def test_generator_methods_are_refused_with_the_fix():
    def gen(self):
        yield torch.ones(2)

    with pytest.raises(TypeError, match="does not support generator methods yet"):
        rd.method(gen)


def test_threaded_actor(ray_session):
    p, c = ThreadedProducer.remote(), Consumer.remote()
    refs = [p.value.remote("views") for _ in range(8)]
    assert ray.get([c.check.remote("views", r) for r in refs]) == [None] * 8
    ray.kill(p)
    ray.kill(c)


def test_async_producer_and_consumer(ray_session):
    p, c = AsyncProducer.remote(), AsyncConsumer.remote()
    ref = p.value.remote("aliasing")
    assert ray.get(c.check.remote("aliasing", ref)) is None
    assert ray.get(c.check_nested.remote("dtypes", [p.value.remote("dtypes")])) is None
    assert check_value("aliasing", ray.get(ref)) is None
    ray.kill(p)
    ray.kill(c)


def test_put_from_driver_task_and_actor(pair):
    p, c = pair
    ref = rd.put(make_value("dtypes"))
    assert ray.get(c.check.remote("dtypes", ref)) is None
    # The driver reading its own object gets its own tensors back, uncopied.
    value = make_value("aliasing")
    same = ray.get(rd.put(value))
    assert same["a"] is value["a"]
    [from_task] = ray.get(task_put.remote("views"))
    assert ray.get(task_check.remote("views", from_task)) is None
    assert check_value("views", ray.get(from_task)) is None
    [from_actor] = ray.get(p.put.remote("numpy"))
    assert ray.get(task_check.remote("numpy", from_actor)) is None


def test_a_driver_publishing_logs_no_ray_warning(ray_session):
    """Naming the object's maker in a driver asked Ray for a task name, which Ray
    answers there with a warning on every put or publish."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ray")
    logger.addHandler(handler)
    try:
        rd.put(torch.ones(4))
        rd.WeightPublisher({"w": torch.ones(4)}, depth=0).publish(1)
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "only available when the process is a worker" in m], seen


def test_ref_passed_back_to_its_producer_is_the_same_tensor(pair):
    p, _ = pair
    ref = p.keep.remote("same")
    assert ray.get(p.is_kept.remote("same", ref)) is True


def test_rd_get_many_refs_concurrently(pair):
    p, c = pair
    refs = [p.value.remote("dtypes") for _ in range(6)] + [rd.put(make_value("views"))]
    values = rd.get(refs, timeout=60)
    assert [check_value("dtypes", v) for v in values[:6]] == [None] * 6
    assert check_value("views", values[6]) is None
    # In an actor too, and forcing a transport.
    got = ray.get(c.get_with_rd.remote(refs[:3], 60))
    assert [check_value("dtypes", v) for v in got] == [None] * 3
    assert check_value("dtypes", rd.get(refs[0], tensor_transport="tcp")) is None


def test_rd_get_timeout(pair):
    p, _ = pair
    # A ref that never resolves within the timeout.
    blocker = Consumer.options(max_concurrency=2).remote()
    never = blocker.wait_gate.remote(60)
    start = time.monotonic()
    # Ray's own timeout (the value not yet returned) is raydirect's error too, as documented.
    with pytest.raises(rd.FetchTimeoutError, match="Ray had not returned every ref's value"):
        rd.get([p.value.remote("dtypes"), never], timeout=1.0)
    assert time.monotonic() - start < 10
    # A transfer that cannot finish in time: 256 MiB over tcp within 1 ms.
    big = p.big.remote(256 << 20, 3)
    ray.wait([big])
    with pytest.raises(ray.exceptions.GetTimeoutError) as info:
        rd.get(big, timeout=0.001, tensor_transport="tcp")
    assert isinstance(info.value, TimeoutError)
    # The process and the producer stay usable.
    assert rd.get(big, timeout=60, tensor_transport="tcp").numel() == 256 << 20
    ray.get(blocker.open_gate.remote())
    ray.kill(blocker)
    # The exception's traceback holds the refs in a cycle: release them now.
    del info, big
    gc.collect()


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1, ValueError), (math.nan, ValueError), ("5", TypeError), (True, TypeError)],
    ids=["negative", "nan", "str", "bool"],
)
def test_a_bad_timeout_is_refused_by_every_call_that_takes_one(pair, timeout, error):
    """Before, -1 timed out at once saying it had waited -1 s, and nan or inf
    failed in Ray ("cannot convert float NaN to integer")."""
    p, _ = pair
    ref = p.value.remote("dtypes")
    calls = {
        "rd.get": lambda: rd.get(ref, timeout=timeout),
        "rd.get_async": lambda: asyncio.run(rd.get_async(ref, timeout=timeout)),
        "rd.wait_tensor_freed": lambda: rd.wait_tensor_freed(torch.ones(1), timeout=timeout),
        "rd.broadcast": lambda: rd.broadcast(ref, [], timeout=timeout),
        "rd.read_ranges": lambda: rd.read_ranges({}, [], into=torch.ones(1), timeout=timeout),
        "rd.notify_region": lambda: rd.notify_region({}, "x", timeout=timeout),
        "publish": lambda: rd.WeightPublisher({"w": torch.ones(2)}).publish(1, timeout=timeout),
        "load": lambda: rd.WeightSubscriber({"w": torch.ones(2)}).load([], timeout=timeout),
    }
    for name, call in calls.items():
        with pytest.raises(error, match="timeout must be None or a number of seconds"):
            call()
            pytest.fail(f"{name} took timeout={timeout!r}")
    assert check_value("dtypes", rd.get(ref, timeout=math.inf)) is None  # no limit


def test_what_is_not_a_ref_or_a_tensor_is_refused_by_name(ray_session):
    """rd.get(5) raised "'int' object is not iterable", and a dict of refs (a ref
    passed as a direct argument arrives as its value) "rd.get of 1 refs takes
    into= as a list"; wait_tensor_freed of a state dict returned at once."""
    ref = rd.put(torch.ones(4))
    for refs, got in ((5, "int"), (None, "NoneType"), ({"w": ref}, "dict")):
        with pytest.raises(TypeError, match=rf"an ObjectRef or a list of them, got {got}"):
            rd.get(refs)
    with pytest.raises(TypeError, match=r"refs\[1\] is a str"):
        rd.get([ref, "ref"])
    with pytest.raises(TypeError, match="got dict"):
        asyncio.run(rd.get_async({"w": ref}))
    with pytest.raises(TypeError, match="takes one tensor .*got dict"):
        rd.wait_tensor_freed({"w": torch.ones(4)}, timeout=0)
    assert torch.equal(rd.get((ref,))[0], torch.ones(4))  # a tuple is a list of refs


def test_unknown_transport_names_the_known_ones(pair):
    p, _ = pair
    with pytest.raises(rd.UnknownTransportError) as info:
        rd.put(torch.ones(2), tensor_transport="carrier-pigeon")
    for name in ("auto", "cma", "cuda_ipc", "gloo", "nccl", "nixl", "shm", "tcp"):
        assert name in str(info.value).split("known transports:")[1]
    with pytest.raises(ValueError, match="carrier-pigeon"):
        rd.get(rd.put(torch.ones(2)), tensor_transport="carrier-pigeon")
    with pytest.raises(ray.exceptions.RayTaskError, match="known transports"):
        ray.get(p.put.remote("dtypes", "carrier-pigeon"))
    with pytest.raises(TypeError, match="rd.method"):
        rd.method(3)


def test_local_stats_count_objects_and_bytes(pair):
    p, c = pair
    wait_for(lambda: ray.get(p.stats.remote()).num_objects == 0, what="store empty")
    ref = p.keep.remote("stats", 20_000)
    stats = ray.get(p.stats.remote())
    assert stats.num_objects == 1 and stats.num_bytes == 80_000
    ray.get(c.summarize.remote(ref))
    # A one-sided read's notice reaches the producer just after the read: poll.
    wait_for(lambda: ray.get(p.stats.remote()).objects_sent.get("cma", 0) >= 1, what="sent")
    del ref
    wait_for(lambda: ray.get(p.stats.remote()).num_objects == 0, what="object freed")


def test_wait_tensor_freed(pair):
    p, _ = pair
    ref = p.keep.remote("wtf")
    ray.wait([ref])
    assert ray.get(p.wait_freed.remote("wtf", 0.2)).startswith("timeout: tensor still held")
    del ref
    assert ray.get(p.wait_freed.remote("wtf", 30)) == "freed"


@pytest.mark.parametrize("method", ["state", "weight_view"])
def test_wait_tensor_freed_knows_the_memory_not_the_tensor_object(pair, method):
    """state_dict() makes new tensor objects each call, and a view is another
    object: waiting on the parameter must still wait while they are held."""
    p, _ = pair
    ref = getattr(p, method).remote()
    ray.wait([ref])
    assert ray.get(p.wait_weight_freed.remote(0.2)).startswith("timeout: tensor still held")
    del ref
    assert ray.get(p.wait_weight_freed.remote(30)) == "freed"


def test_a_conjugated_view_arrives_resolved_and_warns_of_no_write(pair):
    """It travels as a resolved copy; the copy's version counter is not the view's
    (which is its base's, written before the return): no mutation is reported."""
    p, _ = pair
    ray.get(p.record_warnings.remote())
    got = rd.get(p.conj_of_written.remote(), timeout=30)
    assert not got.is_conj()
    assert torch.equal(got, torch.full((1 << 16,), 2 - 2j, dtype=torch.complex64))
    assert not [w for w in ray.get(p.recorded_warnings.remote()) if "modified in place" in w]


def test_in_place_write_after_return_warns_when_sent(pair):
    p, c = pair
    ray.get(p.record_warnings.remote())
    ref = p.keep.remote("mut")
    ray.wait([ref])
    ray.get(p.write_in_place.remote("mut"))
    ray.get(c.summarize.remote(ref))
    found = wait_for(
        lambda: [w for w in ray.get(p.recorded_warnings.remote()) if "modified in place" in w],
        what="mutation warning",
    )
    assert "wait_tensor_freed" in found[0] and "keep" in found[0]
