"""Fixtures of the coordinator's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
