"""``device=`` of ``rd.get``, ``rd.get_async`` and ``rd.set_target``: every
tensor of the value arrives on that device, in memory raydirect allocates there
(a transport that can write there itself writes there, one copy; the others
receive into their own buffer and the tensors are copied over once).
``into=``, the caller's own tensors, is ``_into``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raydirect._tensors import KIND_TORCH, TensorMeta, finish, torch_dtype


def target_device(device: Any) -> torch.device | None:
    """``device=`` of ``rd.get`` and ``rd.set_target``, checked: a device this
    process can allocate on (``ValueError`` naming the fix otherwise)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={device!r} is not a device torch knows: pass 'cpu', 'cuda' or 'cuda:N'"
        ) from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: raydirect receives onto 'cpu' or 'cuda' devices")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}, but this process sees no CUDA device "
            "(torch.cuda.is_available() is False): receive onto 'cpu', or give the "
            "reading actor a GPU (num_gpus=...)"
        )
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r}, but this process sees {torch.cuda.device_count()} CUDA "
            "device(s) (Ray sets CUDA_VISIBLE_DEVICES per actor: its first GPU is 'cuda:0')"
        )
    return torch.device("cuda", index)


def check_device_fits(metas: Sequence[TensorMeta], device: torch.device) -> None:
    """Only torch tensors go to a GPU: numpy and JAX arrays stay where they are."""
    if device.type != "cpu" and any(m.kind != KIND_TORCH for m in metas):
        raise ValueError(
            f"device={str(device)!r} applies to torch tensors, but this value holds numpy "
            "or JAX arrays: receive onto 'cpu' and move them yourself"
        )


def make_targets(
    metas: Sequence[TensorMeta], device: torch.device, skip: Mapping[int, Any]
) -> dict[int, Any]:
    """New tensors on ``device`` for the tensors of ``metas`` not in ``skip``."""
    return {
        i: finish(torch.empty(m.shape, dtype=torch_dtype(m.dtype), device=device), m)
        for i, m in enumerate(metas)
        if i not in skip
    }


def on_device(
    tensors: list[Any], metas: Sequence[TensorMeta], device: torch.device | None
) -> list[Any]:
    """Received tensors on ``device``: those that arrived elsewhere are copied once."""
    if device is None:
        return tensors
    check_device_fits(metas, device)
    return [
        finish(t.detach().to(device), m)
        if isinstance(t, torch.Tensor) and t.device != device
        else t
        for t, m in zip(tensors, metas, strict=True)
    ]
