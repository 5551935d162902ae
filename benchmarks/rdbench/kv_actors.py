"""Workload 11's processes: a vLLM engine with a KV connector as a Ray actor, and
the functions it runs inside its worker (``collective_rpc``, which takes a
function only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

Imports vLLM: only ``rdbench.kv_handoff`` imports this module, and only where
vLLM is installed (.venv-vllm: ``bash scripts/setup-vllm-venv.sh``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import ray
from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group

from raydirect.vllm import kv_worker
from rdbench.common import THP_ENV_VAR, huge_page_bytes

BENCHMARKS = str(Path(__file__).resolve().parents[1])  # rdbench's parent, for the workers
KV_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per engine: 8,192 tokens here, six engines
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # with the progress lines, not in the tables
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with the functions below
}
MAX_MODEL_LEN = 4096
VLLM_SEGMENTS = ("/dev/shm/psm_", "/dev/shm/vllm_")  # its message queues', its TP group's
BLOCK_SIZE = 128  # vLLM's CPU backend's block size: one (layer, block) is one run


# ---------------------------------------------------------------- in the engine's worker


def raydirect_reads(_worker: Any) -> list[dict[str, Any]]:
    """RaydirectConnector's last reads in this worker: bytes and seconds of each."""
    return [r for w in kv_worker.status() for r in w["reads"]]


def nixl_reads(_worker: Any) -> list[dict[str, Any]]:
    """NIXL's telemetry of the transfers this worker finished since the last call
    (post to completion, with the notification); the first call starts recording."""
    # On the class: the stats object itself travels to the scheduler (pickled).
    stats = type(get_kv_transfer_group().connector_worker.xfer_stats)
    if not hasattr(stats, "bench_reads"):
        stats.bench_reads = []
        record = stats.record_transfer

        def recording(self: Any, res: Any) -> None:
            if res is not None:
                stats.bench_reads.append(
                    {"seconds": res.xferDuration / 1e6, "bytes": res.totalBytes}
                )
            record(self, res)

        stats.record_transfer = recording
    taken, stats.bench_reads[:] = list(stats.bench_reads), []
    return taken


def worker_pid(_worker: Any) -> int:
    return os.getpid()


# ---------------------------------------------------------------- the engine


def stat_fields(pid: int, parent: int | None = None) -> list[str]:
    """/proc/PID/stat's fields after the command (state first: ppid is [1])."""
    path = f"/proc/{pid}/stat" if parent is None else f"/proc/{parent}/task/{pid}/stat"
    with open(path) as f:
        return f.read().split(") ", 1)[1].split()


def _cpu_of(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@ray.remote(num_cpus=0)
class KVEngine:
    """vLLM's offline ``LLM`` with one KV connector, bound to one core
    (``VLLM_CPU_OMP_THREADS_BIND``); its worker is a process of its own that
    inherits ``RAY_ADDRESS`` (the connector joins the cluster through it) and
    ``PYTHONPATH`` (to find this module)."""

    def __init__(
        self,
        model: str,
        core: str,
        kv_transfer_config: dict[str, Any],
        env: dict[str, str] | None = None,
    ) -> None:
        os.environ.update(KV_ENV, VLLM_CPU_OMP_THREADS_BIND=core, **(env or {}))
        # The engines' processes allocate as vLLM does by default (bench.py gives
        # every worker PyTorch's huge-page allocator): a KV cache on 4 KiB pages.
        os.environ.pop(THP_ENV_VAR, None)
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        path = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = f"{BENCHMARKS}:{path}" if path else BENCHMARKS
        self.llm = LLM(
            model=model,
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
            block_size=BLOCK_SIZE,
            kv_transfer_config=kv_transfer_config,
        )
        [worker] = self.llm.collective_rpc(worker_pid)
        self._pids = (worker, int(stat_fields(worker)[1]))  # the worker, its engine core

    def generate(self, ids: list[int], params: dict[str, Any] | None) -> tuple[float, Any]:
        """One greedy token of ``ids`` with ``params`` as its ``kv_transfer_params``;
        (seconds, as this process sees it; the output's ``kv_transfer_params``)."""
        extra = None if params is None else {"kv_transfer_params": params}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        started = time.perf_counter()
        [out] = self.llm.generate({"prompt_token_ids": ids}, sampling, use_tqdm=False)
        return time.perf_counter() - started, out.kv_transfer_params

    def rpc(self, fn: Any) -> list[Any]:
        """``fn`` in every worker; their answers' items, flattened."""
        return [item for rank in self.llm.collective_rpc(fn) for item in rank]

    def threads(self) -> list[tuple[str, str, str, float]]:
        """(process, thread name/id, CPUs allowed, CPU seconds) of every thread of
        the worker and the engine core."""
        rows = []
        for proc, pid in zip(("worker", "core"), self._pids, strict=True):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    used = _cpu_of(stat_fields(int(tid), pid))
                    with open(f"/proc/{pid}/task/{tid}/status") as f:
                        status = dict(line.split(":\t", 1) for line in f if ":\t" in line)
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        name = f.read().strip()
                except (FileNotFoundError, ProcessLookupError):
                    continue  # a thread that ended meanwhile
                name = "main" if int(tid) == pid else name
                rows.append((proc, f"{name}/{tid}", status["Cpus_allowed_list"].strip(), used))
        return rows

    def huge_pages(self) -> int:
        """Bytes of the worker's memory on transparent huge pages (a RaydirectConnector
        engine's KV cache once its region is collapsed: ``raydirect._huge_pages``)."""
        return huge_page_bytes(self._pids[0])

    def cpu_seconds(self) -> float:
        """CPU seconds the engine core and worker processes have used."""
        return sum(_cpu_of(stat_fields(pid)) for pid in self._pids)

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue the engine core and worker processes: NIXL's
        pair is stopped while the other rows run (``kv_handoff``'s docstring)."""
        for pid in self._pids:
            os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def shutdown(self) -> None:
        self.pause(False)
        segments = _shared_memory_of(self._pids)
        self.llm.llm_engine.engine_core.shutdown()  # else its processes outlive the actor
        # vLLM leaves some of its message queues' segments behind (a stopped
        # worker never unlinks its own): 160 MiB files, a few per run, before.
        for name in segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)


def _shared_memory_of(pids: tuple[int, ...]) -> set[str]:
    """vLLM's /dev/shm files that the processes ``pids`` map."""
    names: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line}
        names.update(p for p in paths if p.startswith(VLLM_SEGMENTS) and "(deleted)" not in p)
    return names
