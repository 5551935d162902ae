"""``raydirect status``: objects and bytes held per process, and transfer counters."""

from __future__ import annotations

import json
from typing import Any

from raydirect import _channel, _ray, _wire


def collect(timeout: float = 2.0) -> list[dict[str, Any]]:
    """One row per announced agent in the connected cluster; unreachable ones
    (processes that died without withdrawing) are reported and withdrawn."""
    rows = []
    for key, raw in sorted(_ray.published_agents().items()):
        info = json.loads(raw)
        try:
            info["stats"] = dict(
                _channel.request(info["address"], {"op": _wire.STATS}, timeout)["stats"]
            )
            info["reachable"] = True
        except Exception as exc:
            info["stats"] = None
            info["reachable"] = False
            info["error"] = str(exc)
            _ray.withdraw_agent(key)
        rows.append(info)
    return rows


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


_COUNTS = (
    ("held", "objects_held", "bytes_held"),
    ("sent", "objects_sent", "bytes_sent"),
    ("received", "objects_received", "bytes_received"),
)


def _transports(stats: dict[str, Any]) -> list[str]:
    names: set[str] = set()
    for _, objects, nbytes in _COUNTS:
        names.update(stats.get(objects, {}), stats.get(nbytes, {}))
    return sorted(names)


def _cell(stats: dict[str, Any], objects: str, nbytes: str, transport: str) -> str:
    n = stats.get(objects, {}).get(transport, 0)
    return f"{n} / {_human(stats.get(nbytes, {}).get(transport, 0))}" if n else "-"


def totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per transport, summed over every reachable process: the six counters."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        stats = row.get("stats")
        if not stats:
            continue
        for _, objects, nbytes in _COUNTS:
            for key in (objects, nbytes):
                for transport, value in stats.get(key, {}).items():
                    out.setdefault(transport, {})
                    out[transport][key] = out[transport].get(key, 0) + value
    return dict(sorted(out.items()))


def format_table(rows: list[dict[str, Any]]) -> str:
    """Per process: what it holds; under it, one line per transport with objects /
    bytes held, sent and received. Then the same per transport for the cluster."""
    head = (
        f"{'process':<40} {'node':<15} {'pid':>7} {'objects':>8} {'bytes':>11} {'encryption':>10}"
    )
    sub = f"    {'transport':<12} {'held':>20} {'sent':>20} {'received':>20}"
    lines = [head, sub]
    for row in rows:
        name = row.get("label") or "?"
        if row.get("actor_id"):
            name = f"{name} [{row['actor_id'][:8]}]"
        node = str(row.get("address", "")).removeprefix("tcp://").partition("/")[0]
        node = node.rsplit(":", 1)[0]
        stats = row["stats"]
        if stats is None:
            lines.append(f"{name[:40]:<40} {node:<15} {row['pid']:>7}  unreachable (withdrawn)")
            continue
        encryption = stats.get("encryption") or row.get("encryption") or "none"
        lines.append(
            f"{name[:40]:<40} {node:<15} {row['pid']:>7} {stats['num_objects']:>8} "
            f"{_human(stats['num_bytes']):>11} {encryption:>10}"
        )
        for transport in _transports(stats):
            cells = [_cell(stats, o, b, transport) for _, o, b in _COUNTS]
            lines.append(f"    {transport:<12} " + " ".join(f"{c:>20}" for c in cells))
    if not rows:
        lines = ["(no process has used raydirect in this cluster yet)"]
        return "\n".join(lines)
    summed = totals(rows)
    if summed:
        lines += ["", "all processes, per transport (objects / bytes):", sub]
        for transport, counts in summed.items():
            cells = [
                _cell({k: {transport: v} for k, v in counts.items()}, o, b, transport)
                for _, o, b in _COUNTS
            ]
            lines.append(f"    {transport:<12} " + " ".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)
