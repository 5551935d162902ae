"""One two-node Ray cluster (two network namespaces) per multi-node test module.

Nothing here touches the single-node tests' Ray: the pytest process never calls
``ray.init``; drivers run as subprocesses inside the head's namespace (see
mn_harness). The suite skips where network namespaces are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import mn_harness

DRIVER = Path(__file__).with_name("mn_driver.py")
FANOUT_DRIVER = Path(__file__).with_name("mn_fanout_driver.py")


# One cluster per test module: two Ray nodes are heavy on 2 cores, and must be
# gone before the single-node tests run.
@pytest.fixture(scope="module")
def cluster() -> Iterator[mn_harness.Cluster]:
    reason = mn_harness.unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests skipped: {reason}")
    with mn_harness.started() as nodes:
        yield nodes


@pytest.fixture(scope="module")
def cluster3() -> Iterator[mn_harness.Cluster]:
    """Three nodes (head, rdB, rdC) on one bridge, for the fan-out tests."""
    reason = mn_harness.unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests skipped: {reason}")
    with mn_harness.started(workers=2, num_cpus=2) as nodes:
        yield nodes


@pytest.fixture(scope="session")
def driver_script() -> Path:
    return DRIVER


@pytest.fixture(scope="session")
def fanout_script() -> Path:
    return FANOUT_DRIVER
