"""raydirect: move tensors directly between Ray actors, never through the object store.

Decorate a producer method with ``@rd.method``; its tensors stay in the
producer, Ray hands out an ordinary ``ObjectRef``, and whoever consumes the ref
receives the bytes straight from the producer. Memory that lives long and
changes (a KV cache, a staging or ring buffer) is exported once as a region
(``rd.export_region``) and read in ranges by whoever holds its handle
(``rd.read_ranges``).
"""

from raydirect import _metrics  # noqa: F401  (registers the Ray metrics exporter)
from raydirect._api import (
    get,
    get_async,
    local_stats,
    method,
    put,
    set_target,
    wait_tensor_freed,
)
from raydirect._broadcast import broadcast
from raydirect._group_api import create_collective_group, destroy_collective_group
from raydirect._layouts import WeightsHandle
from raydirect._ray import init_ray
from raydirect._region_handle import RegionHandle
from raydirect._region_reads import notify_region, read_ranges, read_ranges_async
from raydirect._regions import Region, export_region
from raydirect._secrets import cluster_secret
from raydirect._store import LocalStats
from raydirect._subscriber import WeightSubscriber
from raydirect._weights import WeightPublisher
from raydirect.errors import (
    FetchTimeoutError,
    GroupError,
    ProducerLostError,
    RaydirectError,
    TransferError,
    TransportUnavailableError,
    UnknownTransportError,
    WeightSyncError,
)
from raydirect.transports.base import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)
from raydirect.transports.registry import register_tensor_transport

__version__ = "0.1.0"

__all__ = [
    "CommunicatorMetadata",
    "FetchRequest",
    "FetchTimeoutError",
    "GroupError",
    "LocalStats",
    "ProducerLostError",
    "RaydirectError",
    "Region",
    "RegionHandle",
    "TensorTransportManager",
    "TensorTransportMetadata",
    "TransferError",
    "TransportUnavailableError",
    "UnknownTransportError",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightSyncError",
    "WeightsHandle",
    "broadcast",
    "cluster_secret",
    "create_collective_group",
    "destroy_collective_group",
    "export_region",
    "get",
    "get_async",
    "init_ray",
    "local_stats",
    "method",
    "notify_region",
    "put",
    "read_ranges",
    "read_ranges_async",
    "register_tensor_transport",
    "set_target",
    "wait_tensor_freed",
]
