"""The actors every workload uses.

Producers hold named int32 tensors (``allocate``), rewrite them in place before
each transfer, outside the timed region (``prepare``), and return them through
one system per method: raydirect per transport (``one_<t>``, ``state_<t>``,
``small_<t>``), Ray's object store (plain methods) and Ray's RDT. Consumers
receive, check every value against its seed, and drop it.

How a weight-sync consumer receives the state dict is a *receiver* in
``RECEIVERS``; adding a way to receive (for instance into preallocated buffers)
is a function plus one entry there, and one entry in ``WEIGHT_SYNC_SYSTEMS`` of
workloads.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ray
import torch

import raydirect as rd
from rdbench.common import (
    ACTOR_NUM_CPUS,
    DTYPE,
    ELEMENT_BYTES,
    FREE_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Layout,
    StandIn,
    check_layout,
    check_pattern,
    fill_layout,
    fill_pattern,
    part_seed,
)
from rdbench.shards import RankBlocks, check_shards, shard_of, sharded_shape

RAYDIRECT_TRANSPORTS = ("auto", "cma", "shm", "tcp", "gloo", "nixl")
POOL_ENV = "RAYDIRECT_RECV_POOL_BYTES"  # raydirect's receive-buffer pool cap


class PatternSource:
    """Producer state: named preallocated tensors, rewritten before each transfer
    (outside the timed region) so every transfer carries fresh bytes."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def allocate(self, layout: Layout) -> int:
        self.tensors = {}  # drop the previous ones first
        for name, shape in layout.items():
            self.tensors[name] = torch.empty(shape, dtype=DTYPE)
        fill_layout(self.tensors, 0)  # touch every page now, not in a timed region
        return sum(t.numel() for t in self.tensors.values()) * ELEMENT_BYTES

    def release(self) -> None:
        self.prepare_free()
        self.tensors = {}

    def wait_free(self, tensor: torch.Tensor) -> None:
        """Block until no earlier object still refers to ``tensor``."""

    def prepare_free(self) -> None:
        for tensor in self.tensors.values():
            self.wait_free(tensor)

    def prepare(self, seed: int) -> int:
        """Wait until no object holds the tensors, then write tensor k with
        ``part_seed(seed, k)``."""
        self.prepare_free()
        fill_layout(self.tensors, seed)
        return seed

    def _one(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def _state(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    @staticmethod
    def _small(seed: int, numel: int) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=DTYPE)  # a new small tensor per call
        fill_pattern(tensor, seed)
        return tensor

    def pid(self) -> int:
        return os.getpid()


def _raydirect_methods() -> dict[str, Any]:
    """``one_<t>``, ``state_<t>`` and ``small_<t>`` for each raydirect transport."""
    methods: dict[str, Any] = {}
    for transport in RAYDIRECT_TRANSPORTS:
        decorate = rd.method(tensor_transport=transport)

        def one(self: PatternSource, name: str) -> torch.Tensor:
            return self._one(name)

        def state(self: PatternSource) -> dict[str, torch.Tensor]:
            return self._state()

        def small(self: PatternSource, seed: int, numel: int) -> torch.Tensor:
            return self._small(seed, numel)

        for fn in (one, state, small):
            fn.__name__ = fn.__qualname__ = f"{fn.__name__}_{transport}"
            methods[fn.__name__] = decorate(fn)

    def one_read_once(self: PatternSource, name: str) -> torch.Tensor:
        """Workload 8's opt-in lifetime: freed after its one read, no lease."""
        return self._one(name)

    methods["one_read_once"] = rd.method(reads=1, ttl=60)(one_read_once)
    return methods


class _Producer(PatternSource):
    """raydirect (``one_<t>``, ``state_<t>``, ``small_<t>``) and plain Ray methods
    (``one``, ``state``, ``small``: the value goes through Ray's object store, or
    inline in the reply when it is small) in one process."""

    def wait_free(self, tensor: torch.Tensor) -> None:
        # Plain Ray methods copy into the object store at return: only raydirect holds.
        rd.wait_tensor_freed(tensor, timeout=FREE_TIMEOUT_S)

    def one(self, name: str) -> torch.Tensor:
        return self._one(name)

    def state(self) -> dict[str, torch.Tensor]:
        return self._state()

    def small(self, seed: int, numel: int) -> torch.Tensor:
        return self._small(seed, numel)

    def number(self, name: str) -> int:
        """Workload 8's baseline: the call of ``one``, returning an int (the seed)."""
        return int(self.tensors[name][0])

    def stand_in(self, name: str) -> StandIn:
        """Workload 13's floor: the call of ``one``, returning a Payload-sized
        object (``StandIn``) that carries the seed."""
        return StandIn(int(self.tensors[name][0]))

    def put_number(self, name: str) -> list[Any]:
        """Workload 13: ``put_auto``'s baseline, a put ref of an int (the seed)."""
        return [ray.put(int(self.tensors[name][0]))]

    def put_auto(self, name: str) -> list[Any]:
        """Workload 13: ``rd.put`` of the tensor, its ref in a list (not resolved by Ray)."""
        return [rd.put(self.tensors[name])]

    def stats(self) -> dict[str, Any]:
        return asdict(rd.local_stats())

    def publish(self, blocks: int = 1) -> Any:
        """Workload 6: the next version of the tensors through rd.WeightPublisher (one
        per allocation, and per ``blocks``: with more than one, every sharded weight
        is stored as that many blocks, rank by rank: ``RankBlocks``); ``prepare``
        writing them in place between steps is the step."""
        made_for = self._published_from
        if made_for is None or made_for[0] is not self.tensors or made_for[1] != blocks:
            rank_blocks = RankBlocks(blocks) if blocks > 1 else None
            self._publisher = rd.WeightPublisher(self.tensors, shard_blocks=rank_blocks)
            self._published_from = (self.tensors, blocks)
        return self._publisher.publish((self._publisher.version or 0) + 1, timeout=FREE_TIMEOUT_S)

    _publisher: Any = None
    _published_from: Any = None


for _name, _fn in _raydirect_methods().items():
    setattr(_Producer, _name, _fn)

Producer: Any = ray.remote(num_cpus=ACTOR_NUM_CPUS)(_Producer)


class _RdtProducer(PatternSource):
    """Ray's built-in RDT: ``@ray.method(tensor_transport="gloo")`` methods; the
    same methods with ``.options(tensor_transport="nixl")`` for RDT over NIXL."""

    def wait_free(self, tensor: torch.Tensor) -> None:
        # Ray logs a "DeprecationWarning: `ray.worker.global_worker`" line here
        # once: its own wait_tensor_freed uses that name.
        from ray.experimental import wait_tensor_freed

        wait_tensor_freed(tensor, timeout=FREE_TIMEOUT_S)

    @ray.method(tensor_transport="gloo")
    def one(self, name: str) -> torch.Tensor:
        return self._one(name)

    @ray.method(tensor_transport="gloo")
    def state(self) -> dict[str, torch.Tensor]:
        return self._state()

    @ray.method(tensor_transport="gloo")
    def small(self, seed: int, numel: int) -> torch.Tensor:
        return self._small(seed, numel)


# RDT receives on a system concurrency group that Ray adds only when the class
# is declared with enable_tensor_transport=True: ``.options(...)`` on a plain
# class does not add it, and the transfer then deadlocks behind the consumer's
# method until Ray's 60 s RDT timeout kills both actors. The producer needs it
# too for ``.options(tensor_transport="nixl")``.
RdtProducer: Any = ray.remote(  # type: ignore[call-overload]
    num_cpus=ACTOR_NUM_CPUS, enable_tensor_transport=True
)(_RdtProducer)


# ---------------------------------------------------------------- consumers


@dataclass(frozen=True)
class Receiver:
    """How a weight-sync consumer turns what ``load`` was given into the state dict.

    ``boxed``: the driver passes ``[ref]`` so that Ray does not resolve the ref and
    the receiver reads it itself; otherwise the ref is a task argument and Ray
    (and raydirect's rebuild hook) resolve it before ``load`` runs."""

    receive: Callable[[Any, Any, Layout], Any]  # (consumer, arg, layout) -> state dict
    boxed: bool


def _receive_argument(consumer: Any, value: Any, layout: Layout) -> Any:
    return value  # Ray resolved the ref as a task argument


def _receive_rd_get(consumer: Any, box: list[Any], layout: Layout) -> Any:
    return rd.get(box[0], timeout=TRANSFER_TIMEOUT_S)


def _receive_into(consumer: Any, box: list[Any], layout: Layout) -> Any:
    # The consumer's own touched tensors, reused every sync (a stale one fails the check).
    return rd.get(box[0], into=consumer.buffers(layout), timeout=TRANSFER_TIMEOUT_S)


def _receive_fresh(consumer: Any, box: list[Any], layout: Layout) -> Any:
    # raydirect's receive-buffer pool off: every sync receives into new memory,
    # as a consumer without the pool (or Ray's object store) would.
    previous = os.environ.get(POOL_ENV)
    os.environ[POOL_ENV] = "0"
    try:
        return rd.get(box[0], timeout=TRANSFER_TIMEOUT_S)
    finally:
        if previous is None:
            del os.environ[POOL_ENV]
        else:
            os.environ[POOL_ENV] = previous


# Another way to receive is a function like these, an entry here, and a
# WeightSyncSystem(..., receiver="<key>") in workloads.WEIGHT_SYNC_SYSTEMS.
RECEIVERS: dict[str, Receiver] = {
    "argument": Receiver(_receive_argument, boxed=False),
    "rd.get": Receiver(_receive_rd_get, boxed=True),
    "into": Receiver(_receive_into, boxed=True),
    "fresh": Receiver(_receive_fresh, boxed=True),
}


class CheckingConsumer:
    """Receives values, checks them cheaply against their seeds, drops them."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[tuple[str, tuple[int, ...]], ...], dict[str, torch.Tensor]] = {}
        self._copy_sources: dict[tuple[int, int], torch.Tensor] = {}

    def consume(self, tensor: Any, seed: int, nbytes: int) -> int:
        """Workloads 1 and 5's peer: one tensor as a task argument."""
        check_pattern(tensor, seed, nbytes)
        return nbytes

    def consume_put(self, refs: list[Any], seed: int, nbytes: int) -> int:
        """Workload 13: ``put_auto``'s or ``put_number``'s ref, read here."""
        value = ray.get(refs[0], timeout=TRANSFER_TIMEOUT_S)
        if isinstance(value, int):
            return self.take_number(value, seed, nbytes)
        return self.consume(value, seed, nbytes)

    def pid(self) -> int:
        return os.getpid()

    def take_stand_in(self, value: StandIn, seed: int, nbytes: int) -> int:
        """Workload 13's floor: the call of ``consume``, taking a ``StandIn``, and
        the one copy of ``nbytes`` into new memory any receive makes (from a
        buffer of this process holding ``seed``'s pattern), checked as ``consume``
        checks a received tensor."""
        if value.seed != seed:
            raise ValueError(f"took seed {value.seed}, expected {seed}")
        source = self._copy_sources.get((seed, nbytes))
        if source is None:  # once per block: its first transfers are not counted
            source = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
            fill_pattern(source, seed)
            self._copy_sources = {(seed, nbytes): source}
        # numpy's copy, one thread like a receive's: torch's clone of 1 MiB wakes
        # its intra-op pool, whose spinning threads cost a 2-core machine 1 ms.
        return self.consume(torch.from_numpy(source.numpy().copy()), seed, nbytes)

    def take_number(self, value: int, seed: int, nbytes: int) -> int:
        """Workload 8's baseline: the call of ``consume``, taking an int."""
        if value != seed:
            raise ValueError(f"took {value}, expected {seed}")
        return nbytes

    def load(self, how: str, arg: Any, seed: int, layout: Layout) -> int:
        """Weight sync: receive the state dict the way ``RECEIVERS[how]`` says, check it."""
        state = RECEIVERS[how].receive(self, arg, layout)
        return check_layout(state, layout, seed)

    def buffers(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Preallocated, touched receive tensors for ``layout``, kept across calls
        (for receivers that fill buffers in place)."""
        key = tuple(layout.items())
        if key not in self._buffers:
            self._buffers = {key: {n: torch.zeros(s, dtype=DTYPE) for n, s in layout.items()}}
        return self._buffers[key]

    def round_trips(
        self,
        producer: Any,
        method: str,
        how: str,
        count: int,
        numel: int,
        seed0: int,
        tensor_transport: str | None = None,
    ) -> list[float]:
        """Small objects: ``count`` times call ``producer.<method>(seed, numel)`` (with
        ``.options(tensor_transport=...)`` if given: RDT), read the ref (``how``:
        ``ray.get`` or ``rd.get``), check it. Returns each round trip's seconds."""
        bound = getattr(producer, method)
        if tensor_transport is not None:
            bound = bound.options(tensor_transport=tensor_transport)
        call = bound.remote
        read = rd.get if how == "rd.get" else ray.get
        times = []
        for i in range(count):
            seed = part_seed(seed0, i)
            start = time.perf_counter()
            value = read(call(seed, numel))
            check_pattern(value, seed, numel * ELEMENT_BYTES)
            times.append(time.perf_counter() - start)
        return times

    def get_many(self, how: str, refs: list[Any], seeds: list[int], nbytes: int) -> int:
        """Concurrency: read every ref at once (``rd.get`` or ``ray.get`` of the list)."""
        values = rd.get(refs, timeout=TRANSFER_TIMEOUT_S) if how == "rd.get" else ray.get(refs)
        for value, seed in zip(values, seeds, strict=True):
            check_pattern(value, seed, nbytes)
        return nbytes * len(values)

    def stats(self) -> dict[str, Any]:
        return asdict(rd.local_stats())

    # ---- workload 6: weight sync through the weight API, and the same job done by hand
    def _targets(self, key: str, rank: int, world: int) -> dict[str, torch.Tensor]:
        """This consumer's own tensors for layout ``key`` (a shard of each when
        ``world`` > 1), kept across steps; found by key (comparing a 5,000-entry
        layout would cost a millisecond a step)."""
        layout = self._layouts[key]
        if world == 1:  # kept by key too: buffers() hashes the 5,000-entry layout
            if getattr(self, "_whole", (None,))[0] != key:
                self._whole = (key, self.buffers(layout))
            return self._whole[1]
        if getattr(self, "_shards", (None,))[0] != (key, rank, world):
            shapes = {n: sharded_shape(n, s, rank, world) for n, s in layout.items()}
            targets = {n: torch.zeros(s, dtype=DTYPE) for n, s in shapes.items()}
            self._shards = ((key, rank, world), targets)
        return self._shards[1]

    def remember_layout(self, key: str, layout: Layout) -> None:
        """Workload 6 sends the layout once: a 5,000-entry dict as an argument of
        every step would cost each consumer ~10 ms to unpickle, for every system."""
        self._layouts = {key: layout}

    def load_weights(self, handle: Any, key: str, rank: int, world: int) -> None:
        """rd.WeightSubscriber into this consumer's own tensors (a shard of each when
        ``world`` > 1); ``check_targets`` checks them afterwards, untimed."""
        targets = self._targets(key, rank, world)
        handle = ray.get(handle) if isinstance(handle, ray.ObjectRef) else handle
        sub_key = (id(targets), rank, world, handle.layout.token)  # a new publisher: a new one
        if getattr(self, "_sub", (None,))[0] != sub_key:
            shard = (lambda n, s: shard_of(n, s, rank, world)) if world > 1 else None
            self._sub = (sub_key, rd.WeightSubscriber(targets, shard=shard))
        self._sub[1].load(handle, timeout=TRANSFER_TIMEOUT_S)

    def get_state_into(self, box: list[Any], key: str) -> None:
        """raydirect's primitives: ``rd.get`` of the trainer's dict straight into this
        consumer's own tensors (``check_targets`` checks them afterwards, untimed)."""
        rd.get(box[0], into=self._targets(key, 0, 1), timeout=TRANSFER_TIMEOUT_S)

    def copy_state(self, state: Any, key: str, rank: int, world: int) -> None:
        """What users write with Ray's object store or RDT: the whole dict arrives as
        a task argument, then each tensor (or this rank's slice of it) is copied
        into the consumer's own tensors, as ``load_state_dict`` does."""
        layout = self._layouts[key]
        targets = self._targets(key, rank, world)
        for name, target in targets.items():
            spec = shard_of(name, layout[name], rank, world) if world > 1 else None
            source = (
                state[name]
                if spec is None
                else state[name].narrow(spec[0], spec[1], spec[2] - spec[1])
            )
            target.copy_(source)

    def check_targets(self, seed: int, key: str, rank: int, world: int) -> int:
        """Check what the last step left in this consumer's tensors (sampled: at
        5,000 tensors a check costs ~10 ms, which would weigh on every row's timing
        and more on many tensors than on one); returns the bytes it holds."""
        targets = self._targets(key, rank, world)
        return check_shards(targets, self._layouts[key], seed, rank, world)


Consumer: Any = ray.remote(num_cpus=ACTOR_NUM_CPUS)(CheckingConsumer)

# See RdtProducer.
RdtConsumer: Any = ray.remote(  # type: ignore[call-overload]
    num_cpus=ACTOR_NUM_CPUS, enable_tensor_transport=True
)(CheckingConsumer)
