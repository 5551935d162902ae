"""rd.broadcast: one object to many actors, the producer read once per node."""

from __future__ import annotations

import pytest
import ray

import actors
from helpers import wait_for

NBYTES = 32 << 20


@pytest.fixture(scope="module")
def producer_and_readers(ray_session):
    p = actors.Producer.remote()
    readers = [actors.Consumer.remote() for _ in range(4)]
    yield p, readers
    for a in [p, *readers]:
        ray.kill(a)


def _sent(actor) -> int:
    return sum(ray.get(actor.stats.remote()).objects_sent.values())


def test_broadcast_to_four_actors_reads_the_producer_once(producer_and_readers):
    import raydirect as rd

    p, readers = producer_and_readers
    before = _sent(p)
    relay_before = _sent(readers[0])
    ref = p.big.remote(NBYTES, 5)
    refs = rd.broadcast(ref, readers, timeout=120)
    assert len(refs) == 4
    summaries = ray.get([r.summarize.remote(x) for r, x in zip(readers, refs, strict=True)])
    expected = ray.get(readers[0].summarize.remote(ref))  # one more, direct read, as reference
    assert all(s == expected for s in summaries), summaries
    assert expected[0] == NBYTES and expected[1] == 5
    # One read for the relay's copy, one for the direct reference read above.
    wait_for(lambda: _sent(p) - before == 2, timeout=30, what="the producer's sent count")
    # The other three readers read from the relay (the relay reads its own copy in place).
    wait_for(lambda: _sent(readers[0]) - relay_before == 3, timeout=30, what="the relay's count")


def test_broadcast_frees_the_relay_copy_with_the_refs(producer_and_readers):
    import raydirect as rd

    p, readers = producer_and_readers
    refs = rd.broadcast(p.big.remote(NBYTES, 9), readers, timeout=120)
    ray.get([r.summarize.remote(x) for r, x in zip(readers, refs, strict=True)])
    assert ray.get(readers[0].stats.remote()).num_objects >= 1
    del refs
    wait_for(
        lambda: ray.get(readers[0].stats.remote()).num_objects == 0,
        timeout=30,
        what="the relay's copy to be freed",
    )


def test_broadcast_of_a_plain_object_and_bad_input(producer_and_readers):
    import raydirect as rd

    _, readers = producer_and_readers
    plain = ray.put(3)
    assert rd.broadcast(plain, readers) == [plain] * 4
    with pytest.raises(TypeError, match="actor handles"):
        rd.broadcast(plain, [1, 2])
    with pytest.raises(TypeError, match="ObjectRef"):
        rd.broadcast("x", readers)
