"""``gloo``: torch.distributed Gloo send/recv inside a collective group; CPU memory.

The Gloo device is created on the node's Ray address, not on whatever the
hostname resolves to: across nodes with distinct addresses, Gloo's default
resolves to 127.0.0.1 and the full-mesh connect fails. Pairs connect lazily,
on their first transfer.
"""

from __future__ import annotations

import datetime
from typing import Any

from torch.distributed import ProcessGroupGloo

from raydirect.transports.collective import CollectiveTransport


class GlooTransport(CollectiveTransport):
    name = "gloo"
    devices = ("cpu",)

    @staticmethod
    def make_process_group(
        store: Any, rank: int, world: int, timeout: datetime.timedelta, host: str
    ) -> Any:
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [ProcessGroupGloo.create_device(hostname=host, lazy_init=True)]
        return ProcessGroupGloo(store, rank, world, options)
