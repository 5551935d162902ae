"""Encryption of the tcp data path (TLS 1.3 on the stream port; the control
channel is CURVE always).

Under Ray's TLS the agent encrypts with no set-up: mutual TLS with Ray's own
certificate files, and its CURVE key rides in its address, inside the
ObjectRef's payload, which Ray itself carries over TLS. The capture test runs
Ray with TLS in a lo-only network namespace."""

from __future__ import annotations

import secrets
from pathlib import Path

import loopback
import pytest
import ray
import torch

import raydirect as rd
from raydirect import _choice, _process, _runtime, _stream_client, _stream_server, _tls, _wire
from raydirect._payload import Payload, ProducerInfo
from raydirect._tensors import TensorMetas

from helpers import Relay, read_through

DRIVER = Path(__file__).with_name("tls_capture_driver.py")


@pytest.fixture(scope="module")
def captured():
    reason = loopback.unavailable_reason()
    if reason:
        pytest.skip(f"capture test skipped: {reason}")
    result = loopback.run(DRIVER, timeout=600)
    print(result)
    return result


def test_under_ray_tls_no_plaintext_crosses_the_wire(captured):
    enc = captured["encrypted"]
    assert enc["exact"]
    pin = _wire.parse_address(enc["address"]).tls or ""
    assert pin.startswith(_tls.RAY_CA + "-") and len(pin) == 3 + 64  # Ray's CA, and its cert
    assert enc["encryption"] == _tls.TLS
    assert enc["captured_bytes"] > 4 << 20  # the transfer itself was captured
    assert not enc["pattern_found"]


def test_the_capture_sees_plaintext_when_encryption_is_off(captured):
    """The control: without it, a capture that saw nothing would pass the test above."""
    plain = captured["plain"]
    assert plain["exact"]
    assert _wire.TLS_MARK not in plain["address"] and plain["encryption"] == _tls.NONE
    assert plain["pattern_found"]


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_a_bad_encrypt_setting_is_refused_with_the_fix(monkeypatch, value):
    monkeypatch.setenv(_tls.ENCRYPT_ENV, value)
    with pytest.raises(ValueError, match="RAYDIRECT_ENCRYPT") as info:
        _tls.encryption_wanted()
    assert "RAY_USE_TLS" in str(info.value)


def test_encryption_can_be_turned_on_without_ray_tls(ray_session):
    """RAYDIRECT_ENCRYPT=1 on a producer without Ray's TLS files: its stream port
    speaks TLS with a certificate it made, pinned by the fingerprint in its address,
    and a consumer reaches it with the ref alone (inline and streamed values)."""

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {_tls.ENCRYPT_ENV: "1"}})
    class Encrypted:
        def __init__(self) -> None:
            self.t = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB

        @rd.method(tensor_transport="tcp")
        def make(self):
            return {"big": self.t, "small": self.t[:10].clone()}

        def address(self) -> str:
            return _runtime.agent().address

        def encryption(self) -> str:
            return rd.local_stats().encryption

    p = Encrypted.remote()
    got = rd.get(p.make.remote(), timeout=60, tensor_transport="tcp")
    assert torch.equal(got["big"], torch.arange(3 << 20, dtype=torch.int32))
    assert got["small"].tolist() == list(range(10))
    address = _wire.parse_address(ray.get(p.address.remote()))
    assert address.tls is not None and len(address.tls) == 64  # a SHA-256 fingerprint
    assert ray.get(p.encryption.remote()) == _tls.TLS
    ray.kill(p)


class _Reachable:
    """Every group reachable: the choice, not a group, is under test."""

    byte_transport = True

    def reachable(self, extra) -> bool:
        return True


def _elsewhere(address: str, transport: str = "auto") -> Payload:
    """A payload of a producer on another node, at agent ``address``."""
    producer = ProducerInfo(
        agent_address=address,
        node_id="another-node",
        pid=1,
        start_time=_process.START_TIME,
        process_token=secrets.token_bytes(16),
        label="Trainer.weights",
    )
    metas = TensorMetas.of([])
    return Payload(b"o" * 16, b"c" * 16, b"", [], metas, transport, producer, {"gloo": {}})


CLEAR = f"tcp://10.0.0.2:5000/curve/{'ab' * 32}"
SEALED = f"{CLEAR}/tls/{'cd' * 32}"


@pytest.fixture
def elsewhere(monkeypatch):
    """This process on node "here", every group reachable, encryption off."""
    monkeypatch.setattr(_choice, "transport_instance", lambda name: _Reachable())
    monkeypatch.setattr(_choice, "_ray", type("R", (), {"node_id": staticmethod(lambda: "here")}))
    monkeypatch.setenv(_tls.ENCRYPT_ENV, "0")
    monkeypatch.delenv("RAYDIRECT_ALLOW_CLEAR", raising=False)


def test_auto_never_picks_a_clear_transport_across_nodes_under_encryption(
    elsewhere, monkeypatch, caplog
):
    """A producer on another node, a gloo group both are in: ``auto`` picks the group
    in clear, and the encrypted ``tcp`` stream when the producer's stream port
    encrypts (its address carries a TLS pin) or this process encrypts; naming the
    group where only the producer encrypts logs a warning, once."""
    assert _choice._choose_auto(_elsewhere(CLEAR), same_node=False) == "gloo"
    assert _choice._choose_auto(_elsewhere(SEALED), same_node=False) == "tcp"
    monkeypatch.setenv(_tls.ENCRYPT_ENV, "1")  # this process encrypts: the same
    assert _choice._choose_auto(_elsewhere(CLEAR), same_node=False) == "tcp"
    monkeypatch.setenv(_tls.ENCRYPT_ENV, "0")
    _choice._logged_fallbacks.discard(("clear", "gloo"))
    with caplog.at_level("WARNING", logger="raydirect"):
        for _ in range(3):
            assert _choice.choose_transport(_elsewhere(SEALED, "gloo"), None) == "gloo"
    warned = [r for r in caplog.records if "in clear" in r.getMessage()]
    assert len(warned) == 1 and "'gloo'" in warned[0].getMessage()


@pytest.mark.parametrize("setting", [{_tls.ENCRYPT_ENV: "1"}, {"RAY_USE_TLS": "1"}])
def test_an_encrypting_process_refuses_clear_bytes_from_another_node(
    elsewhere, monkeypatch, setting
):
    """This process encrypts (RAYDIRECT_ENCRYPT=1, or Ray's TLS with the variable
    unset); the producer on another node does not (its address has no TLS pin):
    every way to read it in clear is refused, naming the producer, this process's
    setting and both fixes: auto and declared tcp, a same-node transport's fallback
    to tcp, tcp forced on a group's object, a clear transport named. Its encrypted
    stream, and anything with RAYDIRECT_ALLOW_CLEAR=1, is read."""
    monkeypatch.delenv(_tls.ENCRYPT_ENV)
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    shown = next(iter(setting.items()))
    for transport, forced in [("auto", None), ("tcp", None), ("cma", None), ("gloo", "tcp")]:
        with pytest.raises(rd.TransferError) as refused:
            _choice.choose_transport(_elsewhere(CLEAR, transport), forced)
        message = str(refused.value)
        assert "Trainer.weights" in message and "another node" in message
        assert f"{shown[0]}={shown[1]}" in message
        assert "RAYDIRECT_ENCRYPT=1 in the producer" in message
        assert "RAYDIRECT_ALLOW_CLEAR=1" in message
    with pytest.raises(rd.TransferError, match="'gloo' moves bytes in clear"):
        _choice.choose_transport(_elsewhere(SEALED, "gloo"), None)
    assert _choice.choose_transport(_elsewhere(SEALED, "tcp"), None) == "tcp"
    assert _choice.choose_transport(_elsewhere(SEALED), None) == "tcp"
    monkeypatch.setenv("RAYDIRECT_ALLOW_CLEAR", "1")  # a mixed cluster, on purpose
    assert _choice.choose_transport(_elsewhere(CLEAR), None) == "tcp"
    assert _choice.choose_transport(_elsewhere(CLEAR, "gloo"), None) == "gloo"
    monkeypatch.setenv("RAYDIRECT_ALLOW_CLEAR", "maybe")
    with pytest.raises(ValueError, match="RAYDIRECT_ALLOW_CLEAR"):
        _choice.choose_transport(_elsewhere(CLEAR), None)


FLIP_AT = 300 << 10  # bytes down a stream connection: inside its first data frame


@ray.remote(num_cpus=0)
class ZerosProducer:
    """8 MiB of zeros over tcp, from a stream port that encrypts (the actor's env)."""

    def __init__(self) -> None:
        self.t = torch.zeros(8 << 20, dtype=torch.uint8)

    @rd.method(tensor_transport="tcp")
    def make(self):
        return self.t

    def stream_port(self) -> int:
        streams = _stream_server.running()
        assert streams is not None
        return streams.port


@pytest.mark.parametrize("records", ["frames", "tls"])
def test_a_bit_flipped_on_the_wire_never_lands_in_the_target(ray_session, monkeypatch, records):
    """An on-path relay flips one ciphertext bit of the window: the read fails, and
    the caller's tensor holds authenticated bytes (zeros) or its old ones (0x11),
    never the flipped one (0x80): a loop that logs a failed load and carries on
    keeps no forged byte."""
    env = {_tls.ENCRYPT_ENV: "1", _tls.RECORDS_ENV: records}
    producer = ZerosProducer.options(runtime_env={"env_vars": env}).remote()
    ref = producer.make.remote()
    ray.wait([ref])
    host = ray.util.get_node_ip_address()
    flipped = []

    def flip(position: int, data: bytes) -> bytes:
        if position <= FLIP_AT < position + len(data):
            changed = bytearray(data)
            changed[FLIP_AT - position] ^= 0x80
            flipped.append(FLIP_AT)
            return bytes(changed)
        return data

    relay = Relay(host, (host, ray.get(producer.stream_port.remote())), down=flip)
    read_through(monkeypatch, relay)  # an on-path attacker
    target = torch.full((8 << 20,), 0x11, dtype=torch.uint8)
    try:
        with pytest.raises(rd.TransferError):
            rd.get(ref, into=target, timeout=60, tensor_transport="tcp")
    finally:
        monkeypatch.undo()
        relay.close()
        _stream_client.close_idle()
    assert flipped, "the relay never reached the window's bytes"
    values = set(target.unique().tolist())
    assert 0x80 not in values, "a forged byte landed in the caller's tensor"
    assert values <= {0x00, 0x11}, values
    got = rd.get(ref, timeout=60, tensor_transport="tcp")  # straight, unharmed
    assert int(got.count_nonzero()) == 0 and got.numel() == 8 << 20
    ray.kill(producer)
