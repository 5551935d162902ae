"""vLLM's OpenAI server as its users start it (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm serve`` command of the CPU build
fails), for the tests that drive an engine over HTTP.

Each server runs in a process group of its own (its engine core and workers are
its children), joins the test session's Ray cluster through ``RAY_ADDRESS``, and
is stopped with its whole group: nothing outlives a test module."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ray
import requests
from vllm_harness import ENGINE_START_TIMEOUT_S, MAX_MODEL_LEN, VLLM_ENV

from helpers import free_port, wait_for

STOP_TIMEOUT_S = 60.0


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out) of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


class ApiServer:
    """One server on ``model`` (float32, eager), started at once; ``wait_ready``
    waits for its ``/health``, ``stop`` ends its process group. ``args`` are more
    command-line options, ``env`` more variables; ``tokenizer``: load the one in
    ``model`` (``vllm_harness.save_tokenizer``), else none (token ids only)."""

    def __init__(
        self,
        model: Path,
        log: Path,
        *args: str,
        env: dict[str, str] | None = None,
        tokenizer: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # the test session's Ray cluster, which the server's workers join (never one
        # a request names: see docs/vllm.md, "Whom the engine trusts")
        context = ray.get_runtime_context()
        full_env = {**os.environ, **VLLM_ENV, **(env or {})}
        full_env.update(RAY_ADDRESS=context.gcs_address, RAY_NAMESPACE=context.namespace)
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--port", str(self.port),
            "--host", "127.0.0.1", *args,
        ]  # fmt: skip
        if not tokenizer:
            command.append("--skip-tokenizer-init")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                command,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, ended whole in stop()
            )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"the server exited:\n{self.log_tail()}"
        try:
            return requests.get(f"{self.url}/health", timeout=2).ok
        except requests.ConnectionError:
            return False

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> None:
        try:
            wait_for(self._healthy, timeout=timeout, what=f"the server at {self.url}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None

    def stop(self) -> None:
        """SIGTERM to the whole group (the server shuts its engine down), SIGKILL
        to whatever is left of it after ``STOP_TIMEOUT_S``."""
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
            wait_for(lambda: not group_members(pgid), timeout=STOP_TIMEOUT_S, what="its children")
        except (subprocess.TimeoutExpired, AssertionError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def api_servers(*servers: ApiServer) -> Iterator[None]:
    """``servers`` (started together) ready; all stopped afterwards, whatever happens."""
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop()
