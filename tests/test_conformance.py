"""The conformance suite of raydirect.testing, run over every transport we ship
that works here, and over a plug-in written the Ray RDT way."""

from __future__ import annotations

import numpy as np
import pytest
import ray

import raydirect as rd
import raydirect.testing

from plugin_transports import GlooPlugin, NumpyShmTransport, PickleShmTransport


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):
    yield


class TestAuto(raydirect.testing.TransportConformance):
    transport = "cma"  # what auto picks between two actors of one node

    def _put(self, case):  # objects declared "auto", counted as the transport auto chose
        import ray

        [ref] = ray.get(self.producer.put.remote(case, "auto", self.data_type))
        return ref

    def test_values_arrive_exactly_over_this_transport(self):
        """Under auto, a value of at most the inline limit comes with Ray's reply
        (nothing moved by a transport); the large one moves over cma."""
        for case in raydirect.testing.CASES:
            before = self._received()
            problem = ray.get(self.consumer.check.remote(case, self._put(case), self.data_type))
            assert problem is None, f"{case}: {problem}"
            moved = self._received() - before
            assert moved == (case == "large"), f"{case}: {moved} objects moved by cma"


class TestCma(raydirect.testing.TransportConformance):
    transport = "cma"


class TestShm(raydirect.testing.TransportConformance):
    transport = "shm"


class TestTcp(raydirect.testing.TransportConformance):
    transport = "tcp"


class TestGloo(raydirect.testing.TransportConformance):
    transport = "gloo"
    group_backend = "gloo"


class TestPicklePlugin(raydirect.testing.TransportConformance):
    transport = "conformance_pickle"

    @classmethod
    def register(cls):
        rd.register_tensor_transport(cls.transport, ["cpu"], PickleShmTransport, replace=True)


class TestTwoSidedGlooPlugin(raydirect.testing.TransportConformance):
    """raydirect's gloo registered again as a plug-in, the proof Ray's own change used."""

    transport = "gloo_plugin"
    group_backend = "gloo"
    manager_cls = GlooPlugin

    @classmethod
    def register(cls):
        rd.register_tensor_transport(cls.transport, ["cpu"], GlooPlugin, replace=True)


class TestNumpyPlugin(raydirect.testing.TransportConformance):
    transport = "conformance_numpy"
    data_type = np.ndarray

    @classmethod
    def register(cls):
        rd.register_tensor_transport(
            cls.transport, ["cpu"], NumpyShmTransport, np.ndarray, replace=True
        )


@pytest.mark.skipif(
    not __import__("raydirect.transports.nixl", fromlist=["available"]).available(),
    reason="NIXL is not installed (pip install 'raydirect[nixl]')",
)
class TestNixl(raydirect.testing.TransportConformance):
    transport = "nixl"
