"""Ranks of a sharded trainer that disagree on a tensor's global shape or dtype are
refused before a byte moves, naming the tensor; the target and its version stay.

The planner indexes each tensor by its first rank's claim, so these are found
beside it (``Published.disagreements``): before this was checked, a rank's
float64 rows landed in a float32 target as garbage, and a rank that placed its
rows in a larger global tensor than the others' loaded without a word.
"""

from __future__ import annotations

import pytest
import torch

import raydirect as rd

GLOBAL = (8, 4)
_PUBLISHERS: list[rd.WeightPublisher] = []  # kept while their handles are loaded


def _rank(start: int, global_shape: tuple[int, ...], dtype: torch.dtype) -> rd.WeightsHandle:
    """A rank holding rows ``start .. start + 4`` of "w" (and a whole "b")."""
    rows = torch.arange(start * 4, (start + 4) * 4, dtype=dtype).view(4, 4)
    local = {"w": rows, "b": torch.ones(3)}

    def placement(name: str, local_shape: tuple[int, ...]):
        return (global_shape, 0, start) if name == "w" else None

    _PUBLISHERS.append(rd.WeightPublisher(local, placement=placement))
    return _PUBLISHERS[-1].publish(1)


@pytest.mark.parametrize(
    ("other", "said"),
    [
        ({"global_shape": (9, 4)}, "ranks disagree on its global shape: rank 0 has (8, 4), rank 1"),
        ({"dtype": torch.float64}, "ranks disagree on its dtype: rank 0 has float32, rank 1"),
    ],
    ids=["global shape", "dtype"],
)
def test_ranks_that_disagree_are_refused_naming_the_tensor(ray_session, other, said):
    second = {"global_shape": GLOBAL, "dtype": torch.float32, **other}
    handles = [_rank(0, GLOBAL, torch.float32), _rank(4, **second)]
    target = {"w": torch.full(GLOBAL, -1.0), "b": torch.zeros(3)}
    sub = rd.WeightSubscriber(target)
    with pytest.raises(rd.WeightSyncError, match="nothing was written") as caught:
        sub.load(handles, timeout=30)
    assert f"'w': {said}" in str(caught.value)
    assert bool((target["w"] == -1.0).all()) and sub.version is None

    # A tensor the target does not load may disagree: the rest loads.
    loose = {"b": torch.zeros(3)}
    assert rd.WeightSubscriber(loose, strict=False).load(handles, timeout=30) == 1
    assert bool((loose["b"] == 1.0).all())
