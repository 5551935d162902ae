"""``raydirect status``: objects and bytes held per process, and transfer counters."""

from __future__ import annotations

import json
from typing import Any

from raydirect import _agent, _ray


def collect(timeout: float = 2.0) -> list[dict[str, Any]]:
    """One row per announced agent in the connected cluster; unreachable ones
    (processes that died without withdrawing) are reported and withdrawn."""
    rows = []
    for key, raw in sorted(_ray.published_agents().items()):
        info = json.loads(raw)
        try:
            info["stats"] = _agent.query_stats(info["address"], timeout)
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


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'process':<40} {'pid':>7} {'objects':>8} {'bytes':>11}  sent / received"]
    for row in rows:
        name = row.get("label") or "?"
        if row.get("actor_id"):
            name = f"{name} [{row['actor_id'][:8]}]"
        stats = row["stats"]
        if stats is None:
            lines.append(f"{name[:40]:<40} {row['pid']:>7}  unreachable (withdrawn)")
            continue
        sent = ", ".join(f"{k} {v}" for k, v in sorted(stats["objects_sent"].items())) or "-"
        recv = ", ".join(f"{k} {v}" for k, v in sorted(stats["objects_received"].items())) or "-"
        lines.append(
            f"{name[:40]:<40} {row['pid']:>7} {stats['num_objects']:>8} "
            f"{_human(stats['num_bytes']):>11}  {sent} / {recv}"
        )
    if not rows:
        lines.append("(no process has used raydirect in this cluster yet)")
    return "\n".join(lines)
