"""Shared test set-up: quiet, offline Flower and one torch thread per process."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import pytest

if TYPE_CHECKING:
    from fedsplit.server.admin.sandbox import Sandbox


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in every process that runs tests. The pytest-xdist controller runs none
    and skips importing torch (seconds of CPU, taken from the workers starting beside it)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _hospital_state_in_tmp(tmp_path_factory: pytest.TempPathFactory,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A ClientApp driven in-process without a ``state-dir`` node config keeps its egress log and
    privacy ledger under a temporary folder, never the user's ``~/.fedsplit``."""
    from fedsplit.client.policy import paths

    root = tmp_path_factory.getbasetemp() / "hospital-state-home"
    monkeypatch.setattr(paths, "default_root", lambda: root)


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    """One upload sandbox (zygote process) shared by every admin-API and web-view test app."""
    from fedsplit.server.admin.sandbox import Sandbox

    shared = Sandbox(workers=2, timeout_s=60)
    yield shared
    shared.close()


@pytest.fixture
def own_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The hospitals' own HDF5 recipe (tests/deploy/recipes/h5_signals.py, ``h5_signals:H5Signals``),
    copied to a folder only ``sys.path`` and PYTHONPATH reach, as a hospital's own code would be."""
    folder = tmp_path / "hospital-code"
    folder.mkdir()
    shutil.copy2(Path(__file__).parent / "deploy" / "recipes" / "h5_signals.py", folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder),
                                                                   os.environ.get("PYTHONPATH")])))
    import h5_signals

    yield h5_signals
    sys.modules.pop("h5_signals", None)


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded random generator."""
    return np.random.default_rng(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test-fast`: ``-n 2 --dist loadgroup``), keep every test of a
    module that uses a module-scoped fixture on one worker, so that fixture (a wheel build,
    Flower's ``--help`` pages, a federation started once) is made once rather than per worker.
    Tests that already name an ``xdist_group`` keep theirs."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = getattr(info, "name2fixturedefs", {})
        if any(d.scope in ("module", "package") for chain in defs.values() for d in chain):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
