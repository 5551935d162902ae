"""``cuda_ipc``: same node, CUDA memory, through CUDA IPC handles.

The producer exports an IPC handle for each tensor's storage (PyTorch's
``_share_cuda_``); the consumer opens the handle and copies device-to-device
into its own receive buffer, so the producer can free its tensor as soon as the
object is gone. One copy, no host round trip.

PyTorch's own cross-process reference count is switched off on both sides:
it expects one release per export, but an object is exported once and read by
any number of consumers (or none), which would leave the producer's memory
held forever or freed early. raydirect already keeps the producer's tensor
alive until the object's last reference is gone, and no read outlives its
reference, so the producer releases its count at export and consumers name a
counter that does not exist (PyTorch skips a missing one without a word).
Written with the same contract as the CPU byte transports; tested where a GPU
is present (the tests skip with a reason elsewhere).
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from raydirect._ranges import Ranges
from raydirect.errors import TransferError, TransportUnavailableError
from raydirect.transports.base import ByteTransport, PeerMetadata, TensorTransportMetadata


def _encode(value: Any) -> Any:
    return {"b64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _decode(value: Any) -> Any:
    return base64.b64decode(value["b64"]) if isinstance(value, dict) else value


# See the module's docstring: the consumer's release of an opened storage finds
# no such counter and does nothing.
_NO_COUNTER = b"/raydirect-no-cuda-ipc-counter"
_SHARE_COUNTER = 4  # (device, handle, size, offset, counter, counter offset, event, sync)


class CudaIpcTransport(ByteTransport):
    name = "cuda_ipc"
    one_sided = True
    devices = ("cuda",)
    receive_devices = ("cuda", "cpu")  # a device-to-host copy straight into host memory
    same_node_only = True
    notify_sent = True

    def extract_tensor_transport_metadata(
        self, obj_id: Any, tensors: list[Any]
    ) -> TensorTransportMetadata:
        handles = []
        for t in tensors:
            storage = t.untyped_storage()
            # (device, handle, size, offset, ref counter handle, ...): all picklable.
            shared = storage._share_cuda_()
            if shared[1] is not None:  # an empty storage has no handle and no counter
                torch.UntypedStorage._release_ipc_counter_cuda(
                    shared[_SHARE_COUNTER], shared[_SHARE_COUNTER + 1]
                )
            handles.append(
                {
                    "share": [_encode(v) for v in shared],
                    "offset": t.storage_offset() * t.element_size(),
                    "nbytes": t.numel() * t.element_size(),
                }
            )
        return TensorTransportMetadata(
            tensor_meta=[], tensor_device="cuda", extra={"handles": handles}
        )

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        if not torch.cuda.is_available():
            raise TransportUnavailableError(
                f"this process sees no CUDA device, so it cannot open {link.who}'s CUDA IPC "
                "handles: give the reading actor a GPU (num_gpus=...), or have the producer "
                "return CPU tensors"
            )
        targets = ranges.dests  # whole tensors: this transport is not ``ranged``
        for target, handle in zip(targets, extra["handles"], strict=True):
            link.check_deadline()
            if handle["nbytes"]:
                try:
                    _copy_from(handle, target)
                except RuntimeError as exc:  # CUDA's own error: say whose memory it was
                    link.check_alive("died before its CUDA memory was read")
                    raise TransferError(
                        f"could not read {link.who}'s CUDA memory over CUDA IPC: {exc}"
                    ) from exc
        torch.cuda.current_stream().synchronize()


def _copy_from(handle: dict[str, Any], target: torch.Tensor) -> None:
    # Opened per transfer and dropped after the copy: a cached handle would keep
    # the producer's memory mapped after it freed the tensor.
    share = [_decode(v) for v in handle["share"]]
    share[_SHARE_COUNTER] = _NO_COUNTER
    storage = torch.UntypedStorage._new_shared_cuda(*share)
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, int(handle["offset"]), (int(handle["nbytes"]),), (1,)
    )
    # Onto a GPU asynchronously; into host memory (device=) a synchronous copy.
    target.copy_(source, non_blocking=target.is_cuda)
