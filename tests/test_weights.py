"""Weight sync: rd.WeightPublisher / rd.WeightSubscriber over a real Ray."""

from __future__ import annotations

import math
import os
import pickle
import signal
from typing import Any

import pytest
import ray
import torch

import raydirect as rd

from actors import ColumnBlocks, Inference, TensorParallel, Trainer, make_weights
from helpers import wait_for

COUNT = 9  # tensors of each small model (3 column-parallel, 3 row-parallel, 3 replicated) + 1


def _assert_state(got: dict, want: dict, shard: TensorParallel | None = None) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        expected = shard.take(name, tensor) if shard else tensor
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), name


def _stepped(count: int, steps: int) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` of ``Trainer.step`` (one add of 1.0 each, as
    float32 rounds them)."""
    weights = make_weights(count)
    for tensor in weights.values():
        if tensor.is_floating_point():
            for _ in range(steps):
                tensor.add_(1.0)
    return weights


@pytest.fixture(scope="module")
def trainer(ray_session):
    t = Trainer.remote(COUNT)
    yield t
    ray.kill(t)


@pytest.fixture(scope="module")
def reader(ray_session):
    r = Inference.remote(COUNT)
    yield r
    ray.kill(r)


def test_a_version_loads_into_the_targets_own_tensors(trainer, reader):
    handle = ray.get(trainer.publish.remote(1))
    assert handle.version == 1 and handle.names == tuple(make_weights(COUNT))
    assert handle.nbytes == sum(t.numel() * t.element_size() for t in make_weights(COUNT).values())
    assert ray.get(reader.load.remote(handle)) == 1
    _assert_state(ray.get(reader.state.remote()), ray.get(trainer.state.remote()))
    assert ray.get(reader.same_tensors.remote()) is True
    assert ray.get(reader.version.remote()) == 1


def test_the_snapshot_is_unaffected_by_an_in_place_step_right_after_publish(trainer, reader):
    before = ray.get(trainer.state.remote())
    handle = ray.get(trainer.publish.remote(2))
    ray.get(trainer.step.remote())  # writes every weight in place before anyone loads
    assert ray.get(reader.load.remote(handle)) == 2
    _assert_state(ray.get(reader.state.remote()), before)


def test_a_stale_version_is_refused_with_nothing_written(trainer, reader):
    loaded = ray.get(reader.state.remote())
    version = ray.get(reader.version.remote())
    old = ray.get(Trainer.remote(COUNT).publish.remote(version))  # same version, other values
    error = ray.get(reader.try_load.remote(old))
    assert error.startswith("WeightSyncError") and "not newer" in error
    assert "nothing was written" in error
    _assert_state(ray.get(reader.state.remote()), loaded)
    assert ray.get(reader.version.remote()) == version


def test_depth_back_pressure_is_released_when_handles_are_dropped(ray_session):
    t = Trainer.remote(COUNT, depth=2)
    ray.get([t.publish.remote(1, keep=True), t.publish.remote(2, keep=True)])
    error = ray.get(t.try_publish.remote(3, timeout=0.5))
    assert error.startswith("WeightSyncError") and "all 2 slots are still held" in error
    ray.get(t.drop_handles.remote())  # the last handles of both versions go
    assert ray.get(t.try_publish.remote(4, timeout=60)) == "ok"
    ray.kill(t)


def test_a_bf16_cast_at_publish(ray_session):
    t = Trainer.remote(COUNT, dtype=torch.bfloat16)
    r = Inference.remote(COUNT, dtype=torch.bfloat16)
    ray.get(r.load.remote(t.publish.remote(1)))
    want = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in make_weights(COUNT).items()
    }
    _assert_state(ray.get(r.state.remote()), want)  # positions stay int64
    ray.kill(t)
    ray.kill(r)


def test_four_tensor_parallel_consumers_get_exactly_their_slices(ray_session):
    """Column-parallel weights by rows, row-parallel by columns (strided), the rest
    replicated: each rank reads about a quarter of the bytes."""
    t = Trainer.remote(COUNT)
    readers = [Inference.remote(COUNT, rank=r, world=4) for r in range(4)]
    handle = t.publish.remote(1)
    assert ray.get([r.load.remote(handle) for r in readers]) == [1] * 4
    full = make_weights(COUNT)
    whole = sum(v.numel() * v.element_size() for v in full.values())
    for rank, r in enumerate(readers):
        shard = TensorParallel(rank, 4)
        _assert_state(ray.get(r.state.remote()), full, shard)
        mine = sum(shard.take(k, v).numel() * v.element_size() for k, v in full.items())
        assert ray.get(r.received.remote()) == mine  # only the slices moved
        assert mine < 0.3 * whole
    sent = sum(ray.get(t.stats.remote()).bytes_sent.values())
    assert sent < 1.2 * whole  # four quarter-reads, not four whole ones
    for actor in (t, *readers):
        ray.kill(actor)


def _rank_regions(layout: Any, parts: int) -> list[list[tuple[int, int]]]:
    """Per rank, the (start, end) bytes of its block of each blocked tensor."""
    regions: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    for i, shape in enumerate(layout.shapes):
        if layout.block_of(i) is not None:
            one = math.prod(shape) * 4 // parts  # float32
            for k in range(parts):
                start = layout.offsets[i] + k * layout.block_stride(i)
                regions[k].append((start, start + one))
    return regions


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "columns-and-rows"])
def test_column_blocks_give_each_rank_one_run_and_everyone_the_right_values(ray_session, rows):
    """shard_blocks=: row-parallel weights stored as one block of columns per rank
    (and column-parallel ones as blocks of rows), each rank's blocks of every
    tensor back to back in the slot. Ranks of the same world read exactly their
    bytes; a whole load and a 2-way shard (two blocks each) rearrange what they
    read and get the same values."""
    t = Trainer.remote(COUNT, shard_blocks=ColumnBlocks(4, rows=rows))
    ranks = [Inference.remote(COUNT, rank=r, world=4) for r in range(4)]
    whole, half = Inference.remote(COUNT), Inference.remote(COUNT, rank=1, world=2)
    handle = t.publish.remote(1)
    for blocks in _rank_regions(ray.get(handle).layout, 4):  # one region per rank
        assert len(blocks) == COUNT // 3 * (2 if rows else 1), blocks
        for (_, end), (start, _) in zip(blocks, blocks[1:], strict=False):
            assert start == (end + 63) // 64 * 64, blocks  # the next cache line
    assert ray.get([r.load.remote(handle) for r in (*ranks, whole, half)]) == [1] * 6
    full = make_weights(COUNT)
    for rank, r in enumerate(ranks):
        shard = TensorParallel(rank, 4)
        _assert_state(ray.get(r.state.remote()), full, shard)
        mine = sum(shard.take(k, v).numel() * v.element_size() for k, v in full.items())
        assert ray.get(r.received.remote()) == mine
    _assert_state(ray.get(whole.state.remote()), full)
    _assert_state(ray.get(half.state.remote()), full, TensorParallel(1, 2))
    ray.get(t.step.remote())  # the next version too: the plans are reused
    assert ray.get(whole.load.remote(t.publish.remote(2))) == 2
    _assert_state(ray.get(whole.state.remote()), ray.get(t.state.remote()))
    for actor in (t, *ranks, whole, half):
        ray.kill(actor)


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [(lambda n, s: (1, 5), "does not split shape"), (lambda n, s: "x", "return None or")],
)
def test_shard_blocks_that_do_not_fit_are_refused_at_publish(ray_session, blocks, expected):
    pub = rd.WeightPublisher(make_weights(COUNT), shard_blocks=blocks)
    with pytest.raises(rd.WeightSyncError, match=expected):
        pub.publish(1)
    with pytest.raises(ValueError, match="needs depth >= 1"):
        rd.WeightPublisher(make_weights(COUNT), depth=0, shard_blocks=ColumnBlocks(4))


@pytest.mark.parametrize("field", ["shape", "dtype", "missing", "unexpected", "shard"])
def test_a_handle_that_does_not_fit_is_refused_before_a_byte_moves(ray_session, field):
    source = make_weights(COUNT)
    pub = rd.WeightPublisher(source)  # from the driver too
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    shard = None
    if field == "shape":
        target["colpar0"] = torch.zeros(63, 32)
    elif field == "dtype":
        target["rowpar1"] = torch.zeros(64, 32, dtype=torch.float64)
    elif field == "missing":
        del target["rep2"]
    elif field == "unexpected":
        target["extra"] = torch.zeros(3)
    else:
        shard = lambda name, shape: (0, 0, 999)  # noqa: E731 - a slice past the tensor
    sub = rd.WeightSubscriber(target, shard=shard)
    handle = pub.publish(1)
    with pytest.raises(rd.WeightSyncError, match="nothing was written") as info:
        sub.load(handle, timeout=60)
    assert {"shape": "colpar0", "dtype": "rowpar1", "missing": "rep2", "unexpected": "extra"}.get(
        field, "does not fit shape"
    ) in str(info.value)
    assert all(not t.any() for t in target.values()) and sub.version is None
    before = rd.local_stats().bytes_received
    assert rd.local_stats().bytes_received == before


def test_strict_false_loads_the_common_names(ray_session):
    source = make_weights(COUNT)
    pub = rd.WeightPublisher(source)
    target = {"colpar0": torch.zeros(64, 32), "extra": torch.zeros(2)}
    sub = rd.WeightSubscriber(target, strict=False)
    assert sub.load(pub.publish(7), timeout=60) == 7
    assert torch.equal(target["colpar0"], source["colpar0"]) and not target["extra"].any()


def test_a_handle_decodes_its_layout_only_when_a_subscriber_has_no_plan_for_it(ray_session):
    """A handle that arrives (unpickled, as from another process) carries its
    layout packed; the first load decodes it to make the plan, a later version of
    the same layout is loaded by the plan made already, its layout never decoded."""
    source = make_weights(COUNT)
    pub = rd.WeightPublisher(source)
    target = {n: torch.zeros_like(t) for n, t in source.items()}
    sub = rd.WeightSubscriber(target)

    def arrived(version: int) -> rd.WeightsHandle:
        return pickle.loads(ray.cloudpickle.dumps(pub.publish(version)))

    first = arrived(1)
    assert first._layout is None  # packed as it came
    assert sub.load(first, timeout=60) == 1 and first._layout is not None  # decoded: a plan
    for tensor in source.values():
        tensor.add_(1)
    second = arrived(2)
    assert second.layout_token == first.layout_token
    assert sub.load(second, timeout=60) == 2 and second._layout is None  # the plan made already
    _assert_state(target, source)
    assert second.names == tuple(source) and second.version == 2  # decoded when asked


def test_five_thousand_small_tensors_arrive_exactly(ray_session):
    t = Trainer.remote(5000)
    r = Inference.remote(5000)
    ray.get(r.load.remote(t.publish.remote(1)))
    _assert_state(ray.get(r.state.remote()), make_weights(5000))
    ray.kill(t)
    ray.kill(r)


def test_five_thousand_tensors_through_the_primitives_step_after_step(ray_session):
    """A plain @rd.method dict read with rd.get(into=), as weight sync without the
    weight API: the second step reuses the layouts the first one kept."""
    t, r = Trainer.remote(5000), Inference.remote(5000)
    for steps in range(2):
        assert ray.get(r.get_into.remote([t.weights_dict.remote()])) is True
        _assert_state(ray.get(r.state.remote()), _stepped(5000, steps))
        ray.get(t.step.remote(wait_free=True))
    names = list(make_weights(5000))[::-7]  # some of them, in another order
    assert ray.get(r.get_into.remote([t.weights_dict.remote()], names)) is True
    want, stepped = _stepped(5000, 1), _stepped(5000, 2)
    want.update({name: stepped[name] for name in names})
    _assert_state(ray.get(r.state.remote()), want)
    ray.kill(t)
    ray.kill(r)


@pytest.mark.parametrize("transport", ["cma", "shm", "tcp", "gloo"])
def test_every_transport_full_and_sharded(ray_session, transport):
    t = Trainer.remote(COUNT, transport=transport)
    full, part = Inference.remote(COUNT), Inference.remote(COUNT, rank=1, world=2)
    if transport == "gloo":
        rd.create_collective_group([t, full, part], backend="gloo")
    handle = t.publish.remote(1)
    assert ray.get([full.load.remote(handle), part.load.remote(handle)]) == [1, 1]
    _assert_state(ray.get(full.state.remote()), make_weights(COUNT))
    _assert_state(ray.get(part.state.remote()), make_weights(COUNT), TensorParallel(1, 2))
    # The driver reads too (gloo falls back to tcp outside the group).
    sub = rd.WeightSubscriber({k: torch.zeros_like(v) for k, v in make_weights(COUNT).items()})
    assert sub.load(ray.get(handle), timeout=60) == 1
    if transport == "gloo":
        rd.destroy_collective_group([t, full, part])
    for actor in (t, full, part):
        ray.kill(actor)


def test_a_handle_borrowed_through_another_process(trainer, reader):
    other = Inference.remote(COUNT)
    version = ray.get(reader.version.remote()) + 1
    handle = trainer.publish.remote(version)
    assert ray.get(reader.forward.remote(other, [handle])) == version
    _assert_state(ray.get(other.state.remote()), ray.get(trainer.state.remote()))
    ray.kill(other)


def test_a_module_target_keeps_its_parameters(ray_session):
    torch.manual_seed(0)
    source, target = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    weight = target.weight
    pub, sub = rd.WeightPublisher(source, depth=0), rd.WeightSubscriber(target)
    sub.load(pub.publish(1), timeout=60)
    assert target.weight is weight and torch.equal(target.weight, source.weight)
    assert torch.equal(target.bias, source.bias)


def test_a_killed_producer_before_a_load_is_a_clear_error_and_the_version_stays(ray_session):
    t = Trainer.remote(COUNT)
    r = Inference.remote(COUNT)
    ray.get(r.load.remote(t.publish.remote(1)))
    handle = t.publish.remote(2)
    ray.wait([handle])
    pid = ray.get(t.pid.remote())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30, what="the trainer to exit")
    error = ray.get(r.try_load.remote(handle, 30), timeout=120)
    assert error.startswith("WeightSyncError") and "sub.version stays 1" in error, error
    assert ray.get(r.version.remote()) == 1
    _assert_state(ray.get(r.state.remote()), make_weights(COUNT))
    ray.kill(r)


def test_bad_arguments_are_refused_at_the_call(ray_session):
    with pytest.raises(TypeError, match="nn.Module or a dict of tensors"):
        rd.WeightPublisher([torch.zeros(2)])
    with pytest.raises(ValueError, match="depth must be an int >= 0"):
        rd.WeightPublisher({"a": torch.zeros(2)}, depth=-1)
    with pytest.raises(ValueError, match="needs depth >= 1"):
        rd.WeightPublisher({"a": torch.zeros(2)}, depth=0, dtype=torch.bfloat16)
    with pytest.raises(rd.UnknownTransportError):
        rd.WeightPublisher({"a": torch.zeros(2)}, tensor_transport="carrier-pigeon")
    pub = rd.WeightPublisher({"a": torch.zeros(2)})
    pub.publish(3)
    with pytest.raises(rd.WeightSyncError, match="not newer"):
        pub.publish(3)
    with pytest.raises(TypeError, match="WeightsHandle"):
        rd.WeightSubscriber({"a": torch.zeros(2)}).load(object())  # type: ignore[arg-type]
    # A string from a config was truthy: strict="false" was strict.
    with pytest.raises(TypeError, match="strict must be True or False, got 'false'"):
        rd.WeightSubscriber({"a": torch.zeros(2)}, strict="false")  # type: ignore[arg-type]


def test_depth_zero_with_a_module_holds_its_parameters_until_the_handle_goes(ray_session):
    source = torch.nn.Linear(16, 8)
    pub = rd.WeightPublisher(source, depth=0)
    handle = pub.publish(1)
    with pytest.raises(TimeoutError):
        rd.wait_tensor_freed(source.weight, timeout=0.5)  # the live parameter is held
    del handle
    rd.wait_tensor_freed(source.weight, timeout=30)  # released with the last handle


def test_a_publisher_keeps_its_layout_until_the_source_changes():
    """Same names, shapes and dtypes: the same layout (subscribers keep their plans
    by its token); any change makes a new one. A layout pickles to an equal one."""
    state = {"a": torch.zeros(4, 2), "b": torch.zeros(3), "c": torch.zeros(2, dtype=torch.int64)}
    pub = rd.WeightPublisher(state, dtype=torch.bfloat16)
    first = pub._layout_of(dict(state))
    assert first.dtypes == ("bfloat16", "bfloat16", "int64")
    assert pub._layout_of({k: v.clone() for k, v in state.items()}) is first
    for changed in (
        {**state, "b": torch.zeros(5)},
        {**state, "b": torch.zeros(3, dtype=torch.float64).int()},
        {"b": state["b"], "a": state["a"], "c": state["c"]},
    ):
        layout = pub._layout_of(changed)
        assert layout is not first and layout.token != first.token
        assert pub._layout_of(dict(changed)) is layout
    assert pickle.loads(pickle.dumps(first)) == first
