"""Write your own two-sided transport: the producer sends while the consumer receives.

Run: ./dev python examples/two_sided_transport.py

A two-sided transport (``is_one_sided()`` False) needs both ends to act, as
Ray's Gloo and NCCL do. raydirect's orchestration runs it: the consumer makes
the communicator metadata, asks the producer's agent to call
``send_multiple_tensors`` with it, and calls ``recv_multiple_tensors`` at the
same time; deadlines, aborts and errors are handled around the pair. This one
meets over a plain TCP socket: the consumer listens on a port it names in the
communicator metadata, and the producer connects and writes the bytes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import ray
import torch

import raydirect as rd


@dataclass
class SocketComm(rd.CommunicatorMetadata):
    host: str = ""
    port: int = 0


class SocketTransport(rd.TensorTransportManager):
    def __init__(self) -> None:
        self._listening: dict[int, socket.socket] = {}  # consumer: port -> listener

    def tensor_transport_backend(self) -> str:
        return "socket"

    @staticmethod
    def is_one_sided() -> bool:
        return False  # the producer's send_multiple_tensors runs for every read

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor) -> bool:
        return True  # any process can listen (the driver too)

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        return rd.TensorTransportMetadata(
            tensor_meta=[(tuple(t.shape), t.dtype) for t in tensors], tensor_device="cpu"
        )

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        # In the consumer: src_actor is the producer's handle, dst_actor ours.
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        self._listening[port] = listener
        return SocketComm("127.0.0.1", port)

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        # In the producer, on its agent's thread, while the consumer receives.
        comm = communicator_metadata
        with socket.create_connection((comm.host, comm.port), timeout=30) as conn:
            for t in tensors:
                conn.sendall(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    def recv_multiple_tensors(
        self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None
    ):
        listener = self._listening.pop(communicator_metadata.port)
        listener.settimeout(30)
        out = []
        with listener, listener.accept()[0] as conn:
            for shape, dtype in tensor_transport_metadata.tensor_meta:
                t = torch.empty(shape, dtype=dtype)
                view = memoryview(t.view(-1).view(torch.uint8).numpy())
                got = 0
                while got < len(view):
                    got += conn.recv_into(view[got:])
                out.append(t)
        return out

    def abort_transport(self, obj_id, communicator_metadata):
        listener = self._listening.pop(getattr(communicator_metadata, "port", 0), None)
        if listener is not None:
            listener.close()


@ray.remote
class Trainer:
    @rd.method(tensor_transport="socket")
    def weights(self):
        return {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)}

    def sends(self) -> int:
        return rd.local_stats().objects_sent.get("socket", 0)


@ray.remote
class Rollout:
    def load(self, weights) -> dict:
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in weights.items()}


if __name__ == "__main__":
    ray.init(logging_level="error")
    trainer, rollout = Trainer.remote(), Rollout.remote()
    rd.register_tensor_transport("socket", ["cpu"], SocketTransport)  # after the actors exist
    ref = trainer.weights.remote()
    print("rollout got", ray.get(rollout.load.remote(ref)))
    print("driver got", rd.get(ref, timeout=30)["w"].sum().item())
    print("sends in the producer:", ray.get(trainer.sends.remote()))
    ray.shutdown()
