"""The fault suite reuses the session's Ray (tests/conftest.py's ``ray_session``)."""

from __future__ import annotations

import probes
from ray import cloudpickle

# Workers cannot import the tests directory: ship the reader actor by value.
cloudpickle.register_pickle_by_value(probes)
