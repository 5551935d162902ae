"""rd.init_ray: ray.init for processes that seeded Python's ``random``.

Ray 2.60 names a driver's GCS subscriptions with ids drawn from ``random``; two
drivers seeded alike (vLLM seeds every worker with the model's seed) subscribed
under one id and made each other, and the GCS, spin."""

from __future__ import annotations

import json
import subprocess
import sys

import ray

DRIVER = """
import json, random, sys
import raydirect as rd

random.seed(0)
drawn = []
draw = random.getrandbits


def recorded(k):
    drawn.append(draw(k))
    return drawn[-1]


random.getrandbits = recorded  # observes what Ray draws while it connects
rd.init_ray(address=sys.argv[1], log_to_driver=False, logging_level="error")
random.getrandbits = draw
expected = random.Random(0)
print(json.dumps({
    "connected": rd._ray.ray.is_initialized(),
    "drawn": drawn,
    "caller_stream_kept": random.random() == expected.random(),
}))
"""


def _driver(address: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, address], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_drivers_seeded_alike_subscribe_under_different_ids(ray_session):
    address = ray.get_runtime_context().gcs_address
    first, second = _driver(address), _driver(address)
    assert first["connected"] and second["connected"]
    # Ray drew its ids from ``random`` (28 bytes per subscriber) ...
    assert len(first["drawn"]) >= 28, first
    # ... and not from the seeded stream: two drivers seeded alike got other ids
    assert first["drawn"] != second["drawn"]
    # while the caller's own stream goes on as if nothing had drawn from it
    assert first["caller_stream_kept"] and second["caller_stream_kept"]
