"""Ray with TLS (certificates made here), loopback traffic captured while a known
byte pattern moves over ``tcp``; run inside a lo-only network namespace by
tests/test_encryption.py (tests/loopback.py).

Two producers: one as Ray's TLS makes it (encrypted), one with
``RAYDIRECT_ENCRYPT=0`` (the control: its bytes must be found in the capture,
or the capture proves nothing). Prints one ``@@RD {json}`` line.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PATTERN = b"raydirect secret weights 0123456789abcdef!?"  # 43 bytes: never page-aligned
PATTERN_BYTES = 4 << 20
RATE_BYTES = 128 << 20
ETH_P_ALL = 0x0003


def make_certificates(folder: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=rd-ca",
            "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    signing = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1"]
    openssl("x509", "-req", "-in", "server.csr", *signing, "-extfile", "san.ext",
            "-out", "server.crt")  # fmt: skip
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(folder / "server.crt"),
        "RAY_TLS_SERVER_KEY": str(folder / "server.key"),
        "RAY_TLS_CA_CERT": str(folder / "ca.crt"),
    }


class Capture:
    """Every frame on ``lo`` while running (an AF_PACKET socket; needs root)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.data = bytearray()
        self.frames = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(1 << 17)
            except TimeoutError:
                continue
            self.data += frame
            self.frames += 1

    def stop(self) -> bytes:
        time.sleep(0.5)  # let the last frames of the transfer land in the socket
        self._stop.set()
        self._thread.join()
        self.sock.close()
        return bytes(self.data)


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="rd-tls-"))
    os.environ.update(make_certificates(folder))
    import ray
    import torch

    import raydirect as rd

    def pattern_tensor(nbytes: int) -> torch.Tensor:
        raw = (PATTERN * (nbytes // len(PATTERN) + 1))[:nbytes]
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self) -> None:
            self.secret = pattern_tensor(PATTERN_BYTES)
            self.bulk = torch.ones(RATE_BYTES, dtype=torch.uint8)

        @rd.method(tensor_transport="tcp")
        def make(self) -> Any:
            return self.secret

        @rd.method(tensor_transport="tcp")
        def make_bulk(self) -> Any:
            return self.bulk

        def agent(self) -> tuple[str, str]:
            from raydirect import _runtime

            return _runtime.agent().address, rd.local_stats().encryption

    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    producers = {
        "encrypted": Producer.remote(),
        "plain": Producer.options(runtime_env={"env_vars": {"RAYDIRECT_ENCRYPT": "0"}}).remote(),
    }
    want = pattern_tensor(PATTERN_BYTES)
    result: dict[str, Any] = {"tls": os.environ["RAY_USE_TLS"]}
    for name, p in producers.items():
        address, encryption = ray.get(p.agent.remote())
        ref = p.make.remote()
        ray.wait([ref])
        capture = Capture()
        got = rd.get(ref, timeout=60, tensor_transport="tcp")
        seen = capture.stop()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            rd.get(p.make_bulk.remote(), timeout=120, tensor_transport="tcp")
            times.append(time.perf_counter() - t0)
        result[name] = {
            "address": address,
            "encryption": encryption,
            "exact": bool(torch.equal(got, want)),
            "captured_bytes": len(seen),
            "pattern_found": PATTERN[:32] in seen,
            "gbps": RATE_BYTES / statistics.median(times) / 1e9,
        }
    print("@@RD " + json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
