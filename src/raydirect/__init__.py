"""raydirect: move tensors directly between Ray actors, never through the object store.

Decorate a producer method with ``@rd.method``; its tensors stay in the
producer, Ray hands out an ordinary ``ObjectRef``, and whoever consumes the ref
receives the bytes straight from the producer.
"""

from raydirect._api import get, local_stats, method, put, wait_tensor_freed
from raydirect._groups import create_collective_group, destroy_collective_group
from raydirect._store import LocalStats
from raydirect.errors import (
    FetchTimeoutError,
    GroupError,
    ProducerLostError,
    RaydirectError,
    TransferError,
    TransportUnavailableError,
    UnknownTransportError,
)

__version__ = "0.1.0"

__all__ = [
    "FetchTimeoutError",
    "GroupError",
    "LocalStats",
    "ProducerLostError",
    "RaydirectError",
    "TransferError",
    "TransportUnavailableError",
    "UnknownTransportError",
    "create_collective_group",
    "destroy_collective_group",
    "get",
    "local_stats",
    "method",
    "put",
    "wait_tensor_freed",
]
