"""Weight sync from a sharded trainer: N ranks to M workers of another split,
each byte from a rank that holds it, checked before a byte moves. Real Ray
actors, and real DTensors over real gloo worlds."""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd

from helpers import wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS, COLS = 16, 12


def full(version: int) -> dict[str, torch.Tensor]:
    """Every global tensor at ``version``: distinct values everywhere."""
    g = torch.Generator().manual_seed(3)
    base = {
        "w": torch.randn(ROWS, COLS, generator=g),
        "norm": torch.randn(COLS, generator=g),  # replicated on every rank
        "emb": torch.randn(ROWS, 4, generator=g),
    }
    return {name: t + version for name, t in base.items()}


def even(extent: int, parts: int) -> list[int]:
    return [extent * i // parts for i in range(parts + 1)]


# How each test's trainer splits each tensor: name -> (dim, cut points) or None (whole).
ROWS_SPLIT = {"w": (0, even(ROWS, 2)), "norm": None, "emb": (0, [0, 5, ROWS])}


@ray.remote(num_cpus=0)
class Rank:
    """One trainer rank: its rows of each tensor, published with ``placement``."""

    def __init__(
        self,
        rank: int,
        split: dict[str, Any],
        dtypes: dict[str, Any] | None = None,
        claims: dict[str, tuple[int, ...]] | None = None,
        depth: int = 2,
        transport: str = "auto",
    ) -> None:
        self.rank, self.split, self.dtypes = rank, split, dtypes or {}
        self.claims = claims or {}  # a global shape to claim instead of the true one
        self.local = {n: self._mine(n, t) for n, t in full(0).items()}
        self.publisher = rd.WeightPublisher(
            self.local, placement=self._placement, depth=depth, tensor_transport=transport
        )
        self.held: list[Any] = []

    def _mine(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        how = self.split.get(name)
        if how is not None:
            dim, cuts = how
            tensor = tensor.narrow(dim, cuts[self.rank], cuts[self.rank + 1] - cuts[self.rank])
        return tensor.clone().to(self.dtypes.get(name, tensor.dtype))

    def _placement(self, name: str, local_shape: tuple[int, ...]) -> Any:
        how = self.split.get(name)
        if how is None:
            return None
        dim, cuts = how
        return self.claims.get(name, tuple(full(0)[name].shape)), dim, cuts[self.rank]

    def publish(self, version: int, timeout: float = 30) -> rd.WeightsHandle:
        for name, tensor in full(version).items():
            self.local[name].copy_(self._mine(name, tensor))
        return self.publisher.publish(version, timeout=timeout)

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()

    def pid(self) -> int:
        return os.getpid()


def _slice(name: str, tensor: torch.Tensor, shard: dict[str, Any], rank: int) -> torch.Tensor:
    how = shard.get(name)
    if how is None:
        return tensor
    dim, cuts = how
    return tensor.narrow(dim, cuts[rank], cuts[rank + 1] - cuts[rank])


@ray.remote(num_cpus=0)
class Worker:
    """One inference worker: its slice of each tensor (``shard``), loaded in place."""

    def __init__(
        self,
        rank: int,
        shard: dict[str, Any],
        names: list[str] | None = None,
        extra: str | None = None,
    ) -> None:
        self.rank, self.shard_spec = rank, shard
        self.target = {
            n: torch.zeros_like(_slice(n, t, shard, rank))
            for n, t in full(0).items()
            if names is None or n in names
        }
        if extra is not None:  # a tensor no rank publishes
            self.target[extra] = torch.zeros(3)
        # Holding some names only: those load, the others are not asked for.
        self.sub = rd.WeightSubscriber(self.target, shard=self._shard, strict=names is None)
        self.held: list[Any] = []

    def _shard(self, name: str, global_shape: tuple[int, ...]) -> Any:
        how = self.shard_spec.get(name)
        if how is None:
            return None
        dim, cuts = how
        return dim, cuts[self.rank], cuts[self.rank + 1]

    def load(self, handles: list[Any], timeout: float = 60) -> int:
        return self.sub.load(handles, timeout=timeout)

    def try_load(self, handles: list[Any], timeout: float = 60) -> str:
        try:
            self.sub.load(handles, timeout=timeout)
        except Exception as exc:
            cause = exc.__cause__
            return f"{type(exc).__name__}: {exc} [cause: {type(cause).__name__}]"
        return "ok"

    def wrong(self, version: int) -> list[str]:
        """Tensors whose values are not ``version``'s slice."""
        want = full(version)
        return [
            n
            for n, t in self.target.items()
            if not torch.equal(t, _slice(n, want[n], self.shard_spec, self.rank))
        ]

    def untouched(self) -> bool:
        return all(not t.any() for t in self.target.values())

    def version(self) -> int | None:
        return self.sub.version

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()

    def slice_bytes(self) -> int:
        return sum(t.nbytes for t in self.target.values())

    def hold(self, handles: list[Any]) -> None:
        self.held.append(handles)

    def pid(self) -> int:
        return os.getpid()


def _received(actor) -> int:
    return sum(ray.get(actor.stats.remote()).bytes_received.values())


def _sent(actor) -> int:
    return sum(ray.get(actor.stats.remote()).bytes_sent.values())


def _kill(actor) -> None:
    ray.kill(actor)


COLS_SPLIT = {"w": (1, even(COLS, 2)), "norm": (0, even(COLS, 2)), "emb": None}


def test_rows_to_columns_each_byte_from_the_rank_that_holds_it(ray_session):
    ranks = [Rank.remote(r, ROWS_SPLIT) for r in range(2)]
    workers = [Worker.remote(w, COLS_SPLIT) for w in range(2)]
    kept = []  # a read's notice is counted only while its version is alive: keep them
    try:
        for version in (1, 2):
            handles = [r.publish.remote(version) for r in ranks]
            kept.append(handles)
            assert ray.get([w.load.remote(handles) for w in workers]) == [version, version]
            assert ray.get([w.wrong.remote(version) for w in workers]) == [[], []]
        # Each worker received exactly its own slices, twice; no byte more.
        for w in workers:
            assert _received(w) == 2 * ray.get(w.slice_bytes.remote())
        # Each rank sent only what the workers asked of it, per version: w, its 8
        # rows of each worker's 6 columns (2 x 192 B); emb, its rows to both workers
        # (rank 0: 5 rows, 2 x 80 B; rank 1: 11 rows, 2 x 176 B); the replicated norm,
        # 24 B per worker, read once, from one rank or the other.
        own = [2 * (2 * 192 + 2 * 80), 2 * (2 * 192 + 2 * 176)]
        expected = sum(own) + 2 * 2 * 24
        # A one-sided read's notice reaches its producer after the read: poll.
        wait_for(lambda: sum(_sent(r) for r in ranks) >= expected, what="the ranks' counts")
        sent = [_sent(r) for r in ranks]
        assert sum(sent) == expected
        assert own[0] <= sent[0] <= own[0] + 96 and own[1] <= sent[1] <= own[1] + 96
    finally:
        for actor in (*ranks, *workers):
            _kill(actor)


def test_replicas_are_read_once_spread_over_their_owners_and_overlaps_move_exactly(ray_session):
    """Eight replicated tensors: the worker reads each once, half from each
    owner. A worker holding rows [3, 9) of emb, which the ranks split [0, 5) and
    [5, 16), reads rows 3-4 from rank 0 and 5-8 from rank 1, nothing else."""
    split = {"emb": (0, [0, 5, ROWS])}  # w and norm replicated
    ranks = [Rank.remote(r, split) for r in range(2)]
    shard = {"emb": (0, [3, 9])}
    worker = Worker.remote(0, shard, names=["emb"])
    whole = Worker.remote(0, {}, names=["w", "norm"])
    try:
        handles = [r.publish.remote(1) for r in ranks]
        assert ray.get([worker.load.remote(handles), whole.load.remote(handles)]) == [1, 1]
        assert ray.get(worker.wrong.remote(1)) == [] and ray.get(whole.wrong.remote(1)) == []
        assert _received(worker) == 6 * 4 * 4  # exactly rows 3-8
        assert _received(whole) == (ROWS * COLS + COLS) * 4  # each replica read once
        sent = [_sent(r) for r in ranks]
        emb = [2 * 4 * 4, 4 * 4 * 4]  # rows 3-4 from rank 0, 5-8 from rank 1
        wait_for(lambda: sum(_sent(r) for r in ranks) == sum(emb) + _received(whole))
        sent = [_sent(r) - e for r, e in zip(ranks, emb, strict=True)]
        assert min(sent) > 0, f"the replicas were all read from one rank: {sent}"
        del handles
    finally:
        for actor in (*ranks, worker, whole):
            _kill(actor)


def _refused(ranks: list[Any], worker: Any, versions: tuple[int, int] = (1, 1)) -> str:
    handles = [r.publish.remote(v) for r, v in zip(ranks, versions, strict=True)]
    message = ray.get(worker.try_load.remote(handles))
    assert ray.get(worker.untouched.remote()) and ray.get(worker.version.remote()) is None
    return message


@pytest.mark.parametrize(
    "case", ["versions", "global shape", "dtype", "gap", "overlap", "no rank holds it"]
)
def test_what_does_not_fit_is_refused_before_a_byte_moves(ray_session, case):
    half = {"w": (0, even(ROWS, 2))}
    splits, options = [half, half], [{}, {}]
    versions, extra = (1, 1), None
    if case == "versions":
        versions, expect = (1, 2), "different versions (rank 0 has 1, rank 1 has 2)"
    elif case == "global shape":
        options[1] = {"claims": {"w": (ROWS + 1, COLS)}}
        expect = "'w': ranks disagree on its global shape"
    elif case == "dtype":
        options[1] = {"dtypes": {"w": torch.float64}}
        expect = "'w': ranks disagree on its dtype: rank 0 has float32, rank 1 has float64"
    elif case == "gap":  # rank 0 holds rows [0, 7), rank 1 [8, 16): row 7 is no one's
        splits = [{"w": (0, [0, 7])}, {"w": (0, [0, 8, ROWS])}]
        expect = "'w': its boxes leave 12 elements no rank holds"
    elif case == "overlap":  # rank 0 [0, 9), rank 1 [7, 16)
        splits = [{"w": (0, [0, 9])}, {"w": (0, [0, 7, ROWS])}]
        expect = "'w': boxes overlap without being the same box"
    else:
        extra, expect = "lm_head", "'lm_head' is in the target but not published"
    ranks = [Rank.remote(r, splits[r], **options[r]) for r in range(2)]
    worker = Worker.remote(0, {}, extra=extra)
    try:
        handles = [r.publish.remote(v) for r, v in zip(ranks, versions, strict=True)]
        message = ray.get(worker.try_load.remote(handles))
        assert message.startswith("WeightSyncError") and message.endswith(
            "nothing was written [cause: NoneType]"
        ), message
        assert expect in message, message
        assert ray.get(worker.untouched.remote()) and ray.get(worker.version.remote()) is None
        assert _received(worker) == 0
    finally:
        for actor in (*ranks, worker):
            _kill(actor)


# ---------------------------------------------------------------- real DTensors


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
class DTensorMember:
    """One process of a gloo world with a DeviceMesh: a trainer rank publishing
    DTensors (FSDP2 keeps its parameters so), or an inference worker whose target
    tensors are DTensors."""

    def __init__(self, rank: int, world: int, port: int, mesh_shape: tuple[int, ...]) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DeviceMesh

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        self.rank = rank
        self.mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))

    def make(self, placements: dict[str, list[str]], version: int) -> None:
        """Every tensor of ``full(version)`` as a DTensor placed as named (collective)."""
        from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

        def placement(p: str) -> Any:
            if p == "replicate":
                return Replicate()
            if p == "partial":
                return Partial()
            return Shard(int(p.removeprefix("shard")))

        self.state = {}
        for name, tensor in full(version).items():
            kinds = [placement(p) for p in placements[name]]
            if "partial" in placements[name]:
                from torch.distributed.tensor import DTensor

                self.state[name] = DTensor.from_local(tensor.clone(), self.mesh, kinds)
            else:
                self.state[name] = distribute_tensor(tensor, self.mesh, kinds)

    def try_publisher(self) -> str:
        try:
            self.publisher = rd.WeightPublisher(self.state)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    def publish(self, version: int) -> rd.WeightsHandle:
        for name, tensor in full(version).items():  # a step: new values, in place
            local = self.state[name].to_local()
            from torch.distributed.tensor import distribute_tensor

            fresh = distribute_tensor(tensor, self.mesh, self.state[name].placements)
            local.copy_(fresh.to_local())
        return self.publisher.publish(version, timeout=30)

    def subscribe(self) -> None:
        self.sub = rd.WeightSubscriber(self.state)

    def load(self, handles: list[Any]) -> int:
        return self.sub.load(handles, timeout=60)

    def locals(self) -> dict[str, torch.Tensor]:
        return {n: t.to_local().clone() for n, t in self.state.items()}

    def expected(self, version: int) -> dict[str, torch.Tensor]:
        """This member's local shards of ``full(version)`` (collective)."""
        from torch.distributed.tensor import distribute_tensor

        return {
            n: distribute_tensor(t, self.mesh, self.state[n].placements).to_local()
            for n, t in full(version).items()
        }

    def received(self) -> int:
        return sum(rd.local_stats().bytes_received.values())


def _world(size: int, mesh_shape: tuple[int, ...]) -> list[Any]:
    port = _free_port()
    return [DTensorMember.remote(r, size, port, mesh_shape) for r in range(size)]


def test_dtensor_ranks_to_dtensor_workers_with_no_placement_or_shard(ray_session):
    """A trainer's DTensors (rows, a replica, columns) to workers whose targets are
    DTensors of another split on a 2-D mesh: no placement=, no shard=."""
    trainers, workers = _world(2, (2,)), _world(2, (2, 1))
    try:
        ray.get(
            [
                t.make.remote({"w": ["shard0"], "norm": ["replicate"], "emb": ["shard1"]}, 0)
                for t in trainers
            ]
        )
        assert ray.get([t.try_publisher.remote() for t in trainers]) == ["ok", "ok"]
        split = {
            "w": ["shard1", "replicate"],
            "norm": ["shard0", "replicate"],
            "emb": ["replicate", "replicate"],
        }
        ray.get([w.make.remote(split, 0) for w in workers])
        ray.get([w.subscribe.remote() for w in workers])
        for version in (1, 2):
            handles = [t.publish.remote(version) for t in trainers]
            assert ray.get([w.load.remote(handles) for w in workers]) == [version, version]
            got = ray.get([w.locals.remote() for w in workers])
            want = ray.get([w.expected.remote(version) for w in workers])
            for g, e in zip(got, want, strict=True):
                assert all(torch.equal(g[n], e[n]) for n in e)
        sizes = [sum(t.nbytes for t in w.values()) for w in want]
        assert ray.get([w.received.remote() for w in workers]) == [2 * s for s in sizes]
    finally:
        for actor in (*trainers, *workers):
            _kill(actor)


def test_a_partial_dtensor_is_refused_at_construction_naming_it(ray_session):
    trainers = _world(2, (2,))
    try:
        ray.get(
            [
                t.make.remote({"w": ["partial"], "norm": ["replicate"], "emb": ["shard0"]}, 0)
                for t in trainers
            ]
        )
        message = ray.get(trainers[0].try_publisher.remote())
        assert message.startswith("WeightSyncError: 'w' is a DTensor placed as Partial"), message
    finally:
        for actor in trainers:
            _kill(actor)


# ---------------------------------------------------------------- failures


def _kill_pid(actor: Any) -> None:
    """Kill the process itself and wait until it is gone (``ray.kill`` marks it dead
    before its memory is)."""
    pid = ray.get(actor.pid.remote())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30, what="the process to exit")


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_rank_that_dies_gives_a_clear_error_and_the_version_stays(ray_session, when):
    # tcp: the producer's agent sends the bytes, so a frozen rank holds its part back
    ranks = [Rank.remote(r, ROWS_SPLIT, transport="tcp") for r in range(2)]
    worker = Worker.remote(0, COLS_SPLIT)
    try:
        assert ray.get(worker.load.remote([r.publish.remote(1) for r in ranks])) == 1
        handles = [r.publish.remote(2) for r in ranks]
        ray.wait(handles, num_returns=2)
        if when == "before":
            _kill_pid(ranks[1])
            pending = worker.try_load.remote(handles, 30)
        else:  # rank 1 frozen: the load waits on it, then it dies
            pid = ray.get(ranks[1].pid.remote())
            os.kill(pid, signal.SIGSTOP)
            before = _sent(ranks[0])
            pending = worker.try_load.remote(handles, 30)
            # Asked of rank 0, not of the worker: the worker's calls wait behind its
            # load, which would end (its connection to the frozen rank timing out)
            # before the rank is killed.
            wait_for(lambda: _sent(ranks[0]) > before, what="rank 0 to send its part")
            os.kill(pid, signal.SIGKILL)
        message = ray.get(pending, timeout=60)
        assert message.startswith("WeightSyncError") and "sub.version stays 1" in message, message
        if when == "before":  # Ray may still hand out its object's value, or not
            assert message.endswith(("[cause: OwnerDiedError]", "[cause: ProducerLostError]"))
        else:
            assert "failed midway" in message and "[cause: ProducerLostError]" in message
        assert ray.get(worker.version.remote()) == 1
    finally:
        for actor in (*ranks, worker):
            _kill(actor)


def test_a_worker_that_dies_holding_handles_never_stalls_the_ranks(ray_session):
    ranks = [Rank.remote(r, ROWS_SPLIT, depth=2) for r in range(2)]
    worker = Worker.remote(0, COLS_SPLIT)
    try:
        for version in (1, 2):  # both slots of each rank, held by the worker alone
            handles = [r.publish.remote(version) for r in ranks]
            assert ray.get(worker.load.remote(handles)) == version
            ray.get(worker.hold.remote(handles))
            del handles
        with pytest.raises(ray.exceptions.RayTaskError, match="slots are still held"):
            ray.get(ranks[0].publish.remote(3, 1.0))
        _kill_pid(worker)
        # Ray's reference counting drops the dead worker's borrowed handles.
        assert ray.get([r.publish.remote(4, 60.0) for r in ranks], timeout=120)
    finally:
        for actor in ranks:
            _kill(actor)
