"""The control channel: bound to the node's address, capability-checked, robust to garbage."""

from __future__ import annotations

import json
import secrets

import pytest
import ray
import zmq

import raydirect as rd
from raydirect import _agent

from actors import Producer, check_value


def agent_address(actor) -> str:
    return ray.get(
        actor.__ray_call__.remote(
            lambda self: __import__("raydirect._agent", fromlist=["agent"]).agent().address
        )
    )


@pytest.fixture(scope="module")
def producer(ray_session):
    p = Producer.remote()
    yield p
    ray.kill(p)


# A context of the test's own: what is checked is the agent, not this process's channels.
_CONTEXT = zmq.Context()


def request(**fields: object) -> bytes:
    """A request as a raydirect process would send it (with the cluster token's proof)."""
    proof = _agent.auth_proof()
    return json.dumps({**fields, **({"auth": proof} if proof else {})}).encode()


def ask(address: str, *frames: bytes) -> dict:
    sock = _CONTEXT.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(list(frames))
        assert sock.poll(60_000), "the agent did not answer"
        return json.loads(sock.recv_multipart()[0])
    finally:
        sock.close()


def test_agent_listens_on_the_node_address_only(producer):
    address = agent_address(producer)
    assert address.startswith(f"tcp://{ray.util.get_node_ip_address()}:")
    assert "0.0.0.0" not in address and "127.0.0.1" not in address


def test_requests_without_the_right_capability_are_refused(producer):
    address = agent_address(producer)
    ref = producer.keep.remote("sec")
    ray.wait([ref])
    [obj_hex] = ray.get(
        producer.__ray_call__.remote(
            lambda self: [
                k.hex() for k in __import__("raydirect._store", fromlist=["store"]).store._objects
            ]
        )
    )
    for cap in (secrets.token_hex(16), "", "00" * 16):
        reply = ask(address, request(op="fetch", obj=obj_hex, cap=cap, transport="tcp"))
        assert reply["ok"] is False and reply["kind"] == "lost"
    for garbage in (
        b"\xff\x00garbage",
        request(),
        request(op="fetch"),
        request(op="fetch", obj="zz", cap="zz"),
    ):
        reply = ask(address, garbage)
        assert reply["ok"] is False and reply["kind"] == "bad_request"
    # Valid JSON that cannot carry the cluster token's proof.
    reply = ask(address, b"[1, 2]")
    assert reply["kind"] == ("unauthenticated" if _agent.auth_proof() else "bad_request")
    # The agent survived all of it and still serves the real holder of the ref.
    assert rd.get(ref, timeout=30, tensor_transport="tcp").tolist() == list(range(1000))
    assert check_value("dtypes", rd.get(producer.value.remote("dtypes"), timeout=30)) is None
