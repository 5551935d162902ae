"""Fixtures of the vLLM tests (run in .venv-vllm, which `./dev test` builds: see
scripts/setup-vllm-venv.sh). An engine takes 18-40 s to start, so a module shares
its engines; the Ray session is the whole run's (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import vllm_harness
from ray import cloudpickle
from vllm_harness import save_llama, start_engine

# Ray's workers cannot import the tests directory: ship the engine actor by value.
cloudpickle.register_pickle_by_value(vllm_harness)

SHM = "/dev/shm"
# vLLM's shared memory: its message queues' (multiprocessing's psm_), its CPU
# tensor-parallel communicator's, and the named semaphores of its spawned
# processes (multiprocessing's sem.mp-, unlinked by a resource tracker that a
# killed engine takes with it). An engine whose actor is killed cannot unlink them.
VLLM_SHM_PREFIXES = ("psm_", "vllm_dist_", "sem.mp-")


def _in_use() -> set[str]:
    """Names under /dev/shm that a live process has open or mapped."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(SHM + "/"):
                        used.add(target[len(SHM) + 1 :].split(" ")[0])
            with open(f"/proc/{pid}/maps") as maps:
                used.update(
                    line.split(SHM + "/", 1)[1].split()[0] for line in maps if SHM + "/" in line
                )
    return used


def _vllm_shm() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(VLLM_SHM_PREFIXES)}


@pytest.fixture(scope="session", autouse=True)
def _no_vllm_shm_left() -> Iterator[None]:
    """At the end, remove the vLLM shared memory this run made that no process
    still uses (engines are stopped by killing their actors): ~500 files a day
    piled up here before. Files of other runs on the machine are left alone."""
    before = _vllm_shm()
    yield
    for name in (_vllm_shm() - before) - _in_use():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM, name))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A random tiny Llama saved as config + safetensors, and its state dict."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_llama(path)


@pytest.fixture(scope="module")
def engine(ray_session: None, tiny_llama: tuple[Path, dict[str, Any]]) -> Iterator[Any]:
    """One engine (an ``Engine`` actor) on the tiny Llama, with the raydirect
    backend turned on, shared by the module."""
    actor = start_engine(tiny_llama[0], weight_transfer_config={"backend": "raydirect"})
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def plain_engine(ray_session: None, tiny_llama: tuple[Path, dict[str, Any]]) -> Iterator[Any]:
    """One engine on the tiny Llama with no weight-transfer backend."""
    actor = start_engine(tiny_llama[0])
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="session")
def tp2_engine(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A tensor-parallel-2 engine on a tiny Llama, shared by every module that
    needs one (it starts two workers: the costliest engine here). Tests compare
    it with the trainer's weights they send, never with its starting ones."""
    path = tmp_path_factory.mktemp("tp2-llama")
    save_llama(path)
    actor = start_engine(
        path, tensor_parallel_size=2, weight_transfer_config={"backend": "raydirect"}
    )
    yield actor
    ray.kill(actor)
