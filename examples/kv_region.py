"""A KV-cache hand-off through a region: prefill exports its paged cache once, decode
reads the blocks of each request straight into its own blocks and notifies, and
prefill frees those blocks the moment it hears.

Run: ./dev python examples/kv_region.py
"""

import json
import threading
import time
import zlib

import ray
import torch

import raydirect as rd

LAYERS, BLOCKS, BLOCK_ELEMS = 4, 64, 2048  # float32: 8 KiB per (layer, block)
BLOCK = BLOCK_ELEMS * 4


def value(request: str, layer: int, block: int) -> float:
    """What prefill 'computes' into a block (the same in every process)."""
    return float(zlib.crc32(f"{request}/{layer}/{block}".encode()) % 1000)


@ray.remote(num_cpus=0)
class Prefill:
    def __init__(self):
        self.kv = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]  # the paged cache
        self.free = set(range(BLOCKS))
        self.lock = threading.Lock()
        # Exported once for the engine's life; notices arrive on a thread of raydirect's.
        self.region = rd.export_region(self.kv, name="kv-cache", on_notice=self.release)

    def release(self, message):  # decode has read the request's blocks: free them
        with self.lock:
            self.free.update(message["blocks"])

    def prefill(self, request: str, tokens: int) -> dict:
        """'Compute' a request's KV into free blocks; return what decode needs (JSON)."""
        with self.lock:
            blocks = sorted(self.free)[: (tokens + 15) // 16]
            self.free.difference_update(blocks)
        for layer, kv in enumerate(self.kv):
            for b in blocks:
                kv[b].fill_(value(request, layer, b))
        params = {"request": request, "blocks": blocks, "region": self.region.handle().to_dict()}
        return json.loads(json.dumps(params))  # what travels in an HTTP request

    def free_blocks(self) -> int:
        with self.lock:
            return len(self.free)


@ray.remote(num_cpus=0)
class Decode:
    def __init__(self):
        self.kv = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]
        self.next = 0

    def receive(self, params: dict) -> bool:
        """Read the request's blocks of every layer into blocks of our own, one call."""
        mine = list(range(self.next, self.next + len(params["blocks"])))
        self.next += len(mine)
        rows = [
            (
                layer,
                b * BLOCK,
                BLOCK,
                layer,
                d * BLOCK,
            )  # (tensor, offset, length, dest, dest_offset)
            for layer in range(LAYERS)
            for b, d in zip(params["blocks"], mine, strict=True)
        ]
        notice = {"request": params["request"], "blocks": params["blocks"]}
        rd.read_ranges(params["region"], rows, into=self.kv, timeout=10.0, notify=notice)
        return all(
            bool((self.kv[layer][d] == value(params["request"], layer, b)).all())
            for layer in range(LAYERS)
            for b, d in zip(params["blocks"], mine, strict=True)
        )


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False)
    prefill, decode = Prefill.remote(), Decode.remote()
    exact = []
    for i, tokens in enumerate([40, 100, 64]):
        params = ray.get(prefill.prefill.remote(f"req-{i}", tokens))
        exact.append(ray.get(decode.receive.remote(params)))
    print(f"decode read every request's blocks exactly: {all(exact)}")
    # Notices travel on their own, after the read returns: wait for them, bounded.
    deadline = time.monotonic() + 30
    while ray.get(prefill.free_blocks.remote()) < BLOCKS and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"prefill's free blocks after the notices: {ray.get(prefill.free_blocks.remote())}")
    ray.shutdown()
