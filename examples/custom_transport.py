"""Write your own transport: a one-sided transport through files in /dev/shm.

Run: ./dev python examples/custom_transport.py

The manager below is written exactly as for Ray's RDT (same method names and
arguments); only the import differs. It is registered *after* the actors
exist, from the driver, and both actors use it at once.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass

import ray
import torch

import raydirect as rd


@dataclass
class FileMetadata(rd.TensorTransportMetadata):
    path: str = ""


class FileTransport(rd.TensorTransportManager):
    def tensor_transport_backend(self) -> str:
        return "file"

    @staticmethod
    def is_one_sided() -> bool:
        return True  # the consumer reads; the producer never calls send

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor) -> bool:
        return True

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        # Producer, when the method returns: write the tensors where consumers can read them.
        path = f"/dev/shm/example-{obj_id}"
        with open(path, "wb") as f:
            pickle.dump(list(tensors), f)
        return FileMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in tensors], tensor_device="cpu", path=path
        )

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        return rd.CommunicatorMetadata()

    def recv_multiple_tensors(
        self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None
    ):
        # Consumer: read them back.
        with open(tensor_transport_metadata.path, "rb") as f:
            return pickle.load(f)

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError("one-sided")

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        # Producer, once no ref is left anywhere in the cluster.
        os.unlink(tensor_transport_meta.path)

    def abort_transport(self, obj_id, communicator_metadata):
        pass


@ray.remote(num_cpus=0)
class Trainer:
    @rd.method(tensor_transport="file")  # named before it is registered: checked per call
    def weights(self):
        return {"w": torch.arange(12.0).reshape(3, 4), "step": 7}


@ray.remote(num_cpus=0)
class Rollout:
    def load(self, weights):
        return float(weights["w"].sum()), weights["step"], rd.local_stats().objects_received


def files() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("example-")]


if __name__ == "__main__":
    ray.init(include_dashboard=False)
    trainer, rollout = Trainer.remote(), Rollout.remote()
    rd.register_tensor_transport("file", ["cpu"], FileTransport)  # after the actors exist
    ref = trainer.weights.remote()
    print("rollout got (sum, step, received):", ray.get(rollout.load.remote(ref)))
    print("files while the ref lives:", len(files()))
    del ref
    deadline = time.monotonic() + 30
    while files() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("files after the ref is gone:", len(files()))
