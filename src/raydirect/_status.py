"""``raydirect status``: objects and bytes held per process, and transfer counters.

Every process that uses raydirect announces its agent in Ray's key-value store
and withdraws it at exit. A process that could not withdraw (killed, or its
exit found the GCS gone and gave up after a second) leaves a stale
announcement; ``collect`` prunes those instead of listing them: a process on
this node whose pid and start time no longer run, one whose node is gone, an
actor Ray reports dead or restarted in another process, or one that does not
answer and cannot be shown alive. A process shown alive that does not answer
is listed as not answering and kept.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from raydirect import _channel, _process, _ray, _wire

_ASKED_AT_ONCE = 16


@dataclass
class Status:
    """What ``collect`` found: ``processes`` (one row per live announced agent;
    ``reachable`` False for one alive but not answering) and ``pruned`` (stale
    announcements withdrawn now, each with its ``reason``)."""

    processes: list[dict[str, Any]] = field(default_factory=list)
    pruned: list[dict[str, Any]] = field(default_factory=list)


def collect(timeout: float = 2.0) -> Status:
    """Ask every announced agent in the connected cluster for its counters, at
    once (``timeout`` each); prune the announcements of processes that are gone."""
    announced = {k: json.loads(raw) for k, raw in sorted(_ray.published_agents().items())}
    nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    here = _ray.node_id()
    status = Status()
    asked = {}
    for key, info in announced.items():
        reason = _gone(info, nodes, here)
        if reason is None:
            asked[key] = info
        else:
            status.pruned.append(_pruned(key, info, reason))
    with ThreadPoolExecutor(max(1, min(_ASKED_AT_ONCE, len(asked)))) as pool:
        answers = dict(
            zip(asked, pool.map(lambda i: _ask(i, timeout), asked.values()), strict=True)
        )
    for key, info in asked.items():
        stats, error = answers[key]
        info.update(stats=stats, reachable=stats is not None)
        if stats is not None:
            status.processes.append(info)
        elif _shown_alive(info, here):
            status.processes.append({**info, "error": error})
        else:
            status.pruned.append(_pruned(key, info, f"did not answer within {timeout:g} s"))
    return status


def _ask(info: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, str]:
    try:
        reply = _channel.request(info["address"], {"op": _wire.STATS}, timeout)
        return dict(reply["stats"]), ""
    except Exception as exc:
        return None, str(exc)


def _gone(info: dict[str, Any], nodes: set[str], here: str) -> str | None:
    """Why the announcing process is known to be gone, without asking it; None
    when it may live."""
    pid = int(info.get("pid", 0))
    if info.get("node_id") not in nodes:
        return "its node left the cluster"
    if info.get("node_id") == here and not _runs_here(info):
        return f"process {pid} exited"
    actor_id = info.get("actor_id")
    if actor_id:
        found = _ray.actor_process(actor_id)
        if found is None or found[0] == "DEAD":
            return "its actor is dead"
        if found[0] == "ALIVE" and found[1] != pid:
            return f"its actor restarted in process {found[1]}"
    return None


def _runs_here(info: dict[str, Any]) -> bool:
    pid, start_time = int(info.get("pid", 0)), info.get("start_time")
    if start_time is None:  # announced by an older raydirect: the pid alone
        return _process.start_time_of(pid) != 0
    return _process.process_alive(pid, int(start_time))


def _shown_alive(info: dict[str, Any], here: str) -> bool:
    if info.get("node_id") == here:
        return _runs_here(info)
    actor_id = info.get("actor_id")
    found = _ray.actor_process(actor_id) if actor_id else None
    return found is not None and found[0] == "ALIVE" and found[1] == int(info.get("pid", 0))


def _pruned(key: str, info: dict[str, Any], reason: str) -> dict[str, Any]:
    _ray.withdraw_agent(key)
    return {**info, "reason": reason}


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


def _name(row: dict[str, Any]) -> str:
    name = str(row.get("label") or "?")
    return f"{name} [{row['actor_id'][:8]}]" if row.get("actor_id") else name


def _node(row: dict[str, Any]) -> str:
    endpoint = str(row.get("address", "")).removeprefix("tcp://").partition("/")[0]
    return endpoint.rsplit(":", 1)[0]  # tcp://ip:port/curve/<key>[/tls/<pin>]


def format_table(status: Status) -> str:
    """Per process: what it holds; under it, one line per transport with objects /
    bytes held, sent and received. Then the same per transport for the cluster,
    and a note on the stale announcements pruned."""
    rows = status.processes
    sub = f"    {'transport':<12} {'held':>20} {'sent':>20} {'received':>20}"
    head = f"{'process':<40} {'node':<15} {'pid':>7} {'objects':>8} {'bytes':>11}"
    lines = [f"{head} {'encryption':>10}", sub]
    for row in rows:
        who = f"{_name(row)[:40]:<40} {_node(row):<15} {row['pid']:>7}"
        stats = row["stats"]
        if stats is None:
            lines.append(f"{who}  alive, not answering")
            continue
        encryption = stats.get("encryption") or row.get("encryption") or "none"
        line = f"{who} {stats['num_objects']:>8} {_human(stats['num_bytes']):>11} {encryption:>10}"
        if stats.get("num_regions"):  # regions are exported apart from objects
            line += f"  + {stats['num_regions']} region(s), {_human(stats['region_bytes'])}"
        lines.append(line)
        for transport in _transports(stats):
            cells = [_cell(stats, o, b, transport) for _, o, b in _COUNTS]
            lines.append(f"    {transport:<12} " + " ".join(f"{c:>20}" for c in cells))
    if not rows:
        lines = ["(no live process has used raydirect in this cluster)"]
    summed = totals(rows)
    if summed:
        lines += ["", "all processes, per transport (objects / bytes):", sub]
        for transport, counts in summed.items():
            cells = [
                _cell({k: {transport: v} for k, v in counts.items()}, o, b, transport)
                for _, o, b in _COUNTS
            ]
            lines.append(f"    {transport:<12} " + " ".join(f"{c:>20}" for c in cells))
    if status.pruned:
        lines += [
            "",
            f"pruned {len(status.pruned)} stale announcement(s) of processes that "
            "ended without withdrawing:",
        ]
        for row in status.pruned:
            who = f"{_name(row)[:40]:<40} {_node(row):<15} {row['pid']:>7}"
            lines.append(f"    {who}  {row['reason']}")
    return "\n".join(lines)
