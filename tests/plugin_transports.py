"""Plug-in transports written the way Ray RDT's guide writes them (tests only)."""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch

import raydirect as rd
from raydirect import (
    _groups,  # the test plug-in finds its group as Ray's gloo does
    _plugin_serve,
)

SHM_DIR = "/dev/shm"


def sends_running(actor: object) -> int:
    """In a producer (through ``__ray_call__``): its two-sided plug-in sends running now."""
    return sum(len(sends) for sends in _plugin_serve._sending.values())


def plugin_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("rdplug-")}


@dataclass
class PickleShmMetadata(rd.TensorTransportMetadata):
    path: str = ""


class PickleShmTransport(rd.TensorTransportManager):
    """One-sided: the producer pickles the tensors into a file in /dev/shm at
    extraction; the consumer unpickles them; garbage collection removes the file."""

    def tensor_transport_backend(self) -> str:
        return "pickle_shm"

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor) -> bool:
        return True

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        path = os.path.join(SHM_DIR, f"rdplug-{obj_id}")
        with open(path, "wb") as f:
            pickle.dump(list(tensors), f)
        return PickleShmMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in tensors], tensor_device="cpu", path=path
        )

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        return rd.CommunicatorMetadata()

    def recv_multiple_tensors(
        self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None
    ):
        with open(tensor_transport_metadata.path, "rb") as f:
            return pickle.load(f)

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError("one-sided")

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        os.unlink(tensor_transport_meta.path)

    def abort_transport(self, obj_id, communicator_metadata):
        pass


class NumpyShmTransport(PickleShmTransport):
    """The same, registered with data_type=numpy.ndarray: it must see only arrays."""

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        if not all(isinstance(t, np.ndarray) for t in tensors):
            raise TypeError(f"expected numpy arrays, got {[type(t) for t in tensors]}")
        return super().extract_tensor_transport_metadata(obj_id, tensors)


class BrokenRecvTransport(PickleShmTransport):
    """Receiving always fails."""

    def recv_multiple_tensors(
        self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None
    ):
        raise RuntimeError("the disk is on fire")


class GatedPrepareTransport(PickleShmTransport):
    """Preparation waits until the test opens a gate (a file): slow preparation on cue."""

    GATE = os.path.join(SHM_DIR, "rdplug-gate")

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        deadline = time.monotonic() + 120
        while not os.path.exists(self.GATE):
            if time.monotonic() > deadline:
                raise TimeoutError("the test never opened the gate")
            time.sleep(0.01)
        return super().extract_tensor_transport_metadata(obj_id, tensors)


class FailingPrepareTransport(PickleShmTransport):
    """Preparation fails (in the background, after the method returned)."""

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        raise OSError("no space left for the staging copy")


class LyingDeviceTransport(PickleShmTransport):
    """Says its tensors are on cuda, whatever its registration and the tensors
    say (as Ray's InvalidDeviceSharedMemoryTransport). Its receive would work:
    only raydirect's check can stop it."""

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        meta = super().extract_tensor_transport_metadata(obj_id, tensors)
        meta.tensor_device = "cuda"
        return meta


class NotATransport:
    pass


class AbortableBrokenTransport(BrokenRecvTransport):
    """Receiving fails; it can abort, and records each abort in a file per process."""

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def abort_transport(self, obj_id, communicator_metadata):
        open(os.path.join(SHM_DIR, f"rdplug-abort-{obj_id}-{os.getpid()}"), "w").close()


# ---------------------------------------------------------------- two-sided


@dataclass
class GlooCommMetadata(rd.CommunicatorMetadata):
    group: str = ""
    generation: str = ""
    src_rank: int = -1
    dst_rank: int = -1
    tag: int = 0


class GlooPlugin(rd.TensorTransportManager):
    """raydirect's gloo written again the way Ray RDT writes a two-sided transport
    (Ray's own gloo is registered through the same call): the producer's
    ``send_multiple_tensors`` and the consumer's ``recv_multiple_tensors`` meet in a
    collective group both actors are in (made with ``rd.create_collective_group``)."""

    def tensor_transport_backend(self) -> str:
        return "gloo_plugin"

    @staticmethod
    def is_one_sided() -> bool:
        return False

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor) -> bool:
        # Only actors in a live gloo group: the driver and tasks fall back.
        return actor is not None and _groups.in_live_group("gloo")

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        return rd.TensorTransportMetadata(
            tensor_meta=[(tuple(t.shape), t.dtype) for t in tensors], tensor_device="cpu"
        )

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        src, dst = src_actor._actor_id.hex(), dst_actor._actor_id.hex()
        for group in _groups.local_groups("gloo").values():
            ranks = {m.actor_id: m.rank for m in group.members}
            if src in ranks and dst in ranks and not group.broken:
                return GlooCommMetadata(
                    group.name, group.generation, ranks[src], ranks[dst], group.next_tag()
                )
        raise ValueError("no live gloo group holds both actors")

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        comm = communicator_metadata
        group = _groups.local_group(comm.group)
        for t in tensors:
            if t.numel():
                group.process_group.send([t.contiguous()], comm.dst_rank, comm.tag).wait()

    def recv_multiple_tensors(
        self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None
    ):
        comm = communicator_metadata
        group = _groups.local_group(comm.group)
        out = [
            torch.empty(shape, dtype=dtype)
            for shape, dtype in tensor_transport_metadata.tensor_meta
        ]
        for t in out:
            if t.numel():
                group.process_group.recv([t], comm.src_rank, comm.tag).wait()
        return out

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        open(os.path.join(SHM_DIR, f"rdplug-gc-{obj_id}"), "w").close()


class HangingTwoSided(rd.TensorTransportManager):
    """Two-sided and unable to abort: both sides block until the test opens a
    gate (a file), as a plug-in whose peer never shows up would."""

    GATE = os.path.join(SHM_DIR, "rdplug-hang-gate")

    def tensor_transport_backend(self) -> str:
        return "hanging"

    @staticmethod
    def is_one_sided() -> bool:
        return False

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        return rd.TensorTransportMetadata(
            tensor_meta=[(tuple(t.shape), t.dtype) for t in tensors], tensor_device="cpu"
        )

    def _wait_gate(self) -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(self.GATE) and time.monotonic() < deadline:
            time.sleep(0.01)

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        self._wait_gate()

    def recv_multiple_tensors(
        self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None
    ):
        self._wait_gate()
        return [torch.zeros(s, dtype=d) for s, d in tensor_transport_metadata.tensor_meta]


class SlowStagingTransport(PickleShmTransport):
    """Stages its copy slowly (a large region's copy): a reader with a short
    deadline gives up while the owner's agent is still preparing the read."""

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        time.sleep(0.6)
        return super().extract_tensor_transport_metadata(obj_id, tensors)
