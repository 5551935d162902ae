"""A region's handle: everything a reader needs, as data that survives JSON.

``rd.export_region`` returns a ``Region``; its ``handle()`` is this. It travels
however the application likes (a Ray argument, pickle, or JSON through an HTTP
request: vLLM's ``kv_transfer_params``) and any process of the cluster that
holds it reads the region with no Ray call: the owner's agent address (with
its CURVE key and TLS pin), the owner's identity (node, pid and start time,
process token), the tensors' layout, the region's id and 128-bit capability,
and each byte transport's metadata (``cma``'s addresses and seal).

It is a bearer capability: whoever holds it can read the region (nothing else;
the agent checks the id, the capability and every range against the region's
own sizes, and a ``cma`` reader's seal covers the addresses and sizes it reads
by: ``payload``) and notify its owner. Its ``repr`` leaves the capability out.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from raydirect import _wire
from raydirect._payload import Payload, ProducerInfo
from raydirect._region_seals import region_extent
from raydirect._tensors import TensorMetas

FORMAT = 1  # bumped when a field changes meaning: an older reader refuses a newer handle


@dataclass(frozen=True, repr=False)
class RegionHandle:
    """What a reader needs to read a region (``Region.handle()``): small,
    picklable, and JSON-safe (``to_json``/``from_json``, ``to_dict``/``from_dict``;
    ``rd.read_ranges`` takes any of the three forms). Holding it is what lets a
    process read the region, and nothing else: keep it as secret as the data."""

    region: str
    """The region's id (hex)."""
    capability: str
    name: str
    """The name given at export, for messages."""
    names: tuple[str, ...] | None
    """The tensors' names when a dict was exported (``index(name)`` gives a
    tensor's index for rows), else None."""
    nbytes: tuple[int, ...]
    """Each tensor's size in bytes: rows' offsets count from each tensor's start."""
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    device: str
    transport: str
    """The transport named at export (``auto``: each reader chooses)."""
    agent: str
    node_id: str
    pid: int
    start_time: int
    process_token: str
    owner: str
    """Who exported it (``Class.method``, a task's name, ``driver``), for messages."""
    meta: str = "null"
    frames: tuple[str, ...] = ()
    served: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (
            f"RegionHandle(name={self.name!r}, tensors={len(self.nbytes)}, "
            f"nbytes={sum(self.nbytes)}, owner={self.describe()!r})"
        )

    def describe(self) -> str:
        """The region and its owner, as messages name them."""
        host = self.agent.removeprefix("tcp://").split("/", 1)[0].rsplit(":", 1)[0]
        return f"region {self.name!r} of {self.owner} (pid {self.pid} on {host})"

    def index(self, name: str) -> int:
        """The index of the tensor exported under ``name`` (a dict's key)."""
        if self.names is None:
            raise ValueError(f"{self.describe()} was exported from a list: rows use indices")
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"{self.describe()} has no tensor {name!r}") from None

    def to_dict(self) -> dict[str, Any]:
        """The handle as plain JSON types (``json.dumps`` takes it as is)."""
        out = dataclasses.asdict(self)
        out["names"] = None if self.names is None else list(self.names)
        out["shapes"] = [list(s) for s in self.shapes]
        for key in ("nbytes", "dtypes", "frames", "served"):
            out[key] = list(out[key])
        out["v"] = FORMAT
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> RegionHandle:
        """A handle from ``to_dict``'s form; ``ValueError`` for anything else."""
        if not isinstance(data, dict) or data.get("v") != FORMAT:
            version = data.get("v") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"not a raydirect region handle of format {FORMAT} (got {version!r}): pass "
                "what Region.handle() gave, or its to_dict()/to_json()"
            )
        try:
            return cls._checked(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a malformed region handle: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def _checked(cls, data: dict[str, Any]) -> RegionHandle:
        names = data["names"]
        handle = cls(
            region=_text(data["region"]),
            capability=_text(data["capability"]),
            name=_text(data["name"]),
            names=None if names is None else tuple(_text(n) for n in names),
            nbytes=tuple(_whole(n) for n in data["nbytes"]),
            dtypes=tuple(_text(d) for d in data["dtypes"]),
            shapes=tuple(tuple(_whole(n) for n in s) for s in data["shapes"]),
            device=_text(data["device"]),
            transport=_text(data["transport"]),
            agent=_text(data["agent"]),
            node_id=_text(data["node_id"]),
            pid=_whole(data["pid"]),
            start_time=_whole(data["start_time"]),
            process_token=_text(data["process_token"]),
            owner=_text(data["owner"]),
            meta=_text(data["meta"]),
            frames=tuple(_text(f) for f in data["frames"]),
            served=tuple(_text(s) for s in data["served"]),
        )
        bytes.fromhex(handle.region)
        bytes.fromhex(handle.capability)
        bytes.fromhex(handle.process_token)
        count = len(handle.nbytes)
        if not count or len(handle.dtypes) != count or len(handle.shapes) != count:
            raise ValueError("the layout's columns differ in length")
        if handle.names is not None and len(handle.names) != count:
            raise ValueError("the names do not match the tensors")
        return handle

    @classmethod
    def from_json(cls, text: str | bytes) -> RegionHandle:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not a region handle's JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def of(cls, data: Any) -> RegionHandle:
        """``data`` as a handle: a handle, its ``to_dict()`` or its ``to_json()``."""
        if isinstance(data, RegionHandle):
            return data
        if isinstance(data, (str, bytes)):
            return cls.from_json(data)
        if isinstance(data, dict):
            return cls.from_dict(data)
        raise TypeError(
            f"expected a region handle (Region.handle(), or its to_dict()/to_json()), "
            f"got {type(data).__name__}"
        )

    def payload(self) -> Payload:
        """The handle as the consumer layer reads objects: a Payload with no lease."""
        frames = [base64.b64decode(f) for f in self.frames]
        try:  # byte transports' metadata only: plain values, no classes to build
            transport_meta = _wire.decode_value(json.loads(self.meta), frames, {}) or {}
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"a malformed region handle: its metadata: {exc}") from exc
        transport_meta = self._with_extent(transport_meta)
        count = len(self.nbytes)
        producer = ProducerInfo(
            agent_address=self.agent,
            node_id=self.node_id,
            pid=self.pid,
            start_time=self.start_time,
            process_token=bytes.fromhex(self.process_token),
            label=f"region {self.name!r} of {self.owner}",
            transports=self.served,
        )
        metas = TensorMetas(
            list(self.shapes), list(self.dtypes), list(self.nbytes), [self.device] * count
        )
        return Payload(
            obj_id=bytes.fromhex(self.region),
            capability=bytes.fromhex(self.capability),
            skeleton=b"",
            handles=[],
            metas=metas,
            transport=self.transport,
            producer=producer,
            transport_meta=transport_meta,
        )

    def _with_extent(self, transport_meta: Any) -> dict[str, Any]:
        """The metadata with ``cma``'s extent made here, from the addresses and sizes
        a ``cma`` read goes by, never taken from the handle: the seal covers the
        extent (``_region_seals.region_extent``), so an edited address or size
        reads nothing. ``ValueError`` for metadata with no seal or addresses to
        check: a handle that dropped them would skip the check."""
        if not isinstance(transport_meta, dict):
            raise ValueError("a malformed region handle: its metadata is not a dict")
        cma = transport_meta.get("cma")
        if not isinstance(cma, dict) or cma.get("seal") is None:
            raise ValueError("a malformed region handle: its cma metadata names no seal")
        ptrs = cma.get("ptrs")
        if not isinstance(ptrs, bytes):
            raise ValueError("a malformed region handle: its cma metadata has no addresses")
        extent = region_extent(ptrs, self.nbytes)
        return {**transport_meta, "cma": {**cma, "extent": extent}}


def encode_meta(transport_meta: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """Byte transports' metadata as the handle carries it: JSON, bytes in base64."""
    frames: list[bytes] = []
    encoded = json.dumps(_wire.encode_value(transport_meta, frames))
    return encoded, tuple(base64.b64encode(f).decode("ascii") for f in frames)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _whole(value: Any) -> int:
    """A whole number that fits the int64 arithmetic of the reads (``ValueError``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"{value!r} is not a whole number below 2**63")
    return value
