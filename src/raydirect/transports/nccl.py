"""``nccl``: NCCL send/recv inside a collective group; CUDA memory.

NCCL ignores tags, so transfers between a pair are serialised on both sides
(the shared logic in ``collective``). Written with the same code paths as
``gloo``; tested where a GPU is present.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from raydirect.transports.collective import CollectiveTransport


class NcclTransport(CollectiveTransport):
    name = "nccl"
    devices = ("cuda",)
    serialize_pairs = True

    @staticmethod
    def make_process_group(
        store: Any, rank: int, world: int, timeout: datetime.timedelta, host: str
    ) -> Any:
        from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world, options)

    def synchronize(self) -> None:
        # NCCL work completes on a stream; the host must wait before using the bytes.
        torch.cuda.current_stream().synchronize()
