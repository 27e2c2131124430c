"""The GPU backend (`aggregation._device`): on the CPU here, on CUDA where there is a GPU.

`TorchDevice` runs the same torch code on ``torch.device("cpu")``, so the GPU path's logic is
checked against the numpy reference on every machine; the CUDA test runs only where torch
sees a GPU. Tolerances are the ones docs/aggregation.md ("The coordinator's GPU") documents.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation._device import TorchDevice, resolve
from fedsplit.aggregation.errors import AggregationError
from fedsplit.aggregation.settings import BackendSettings
from fedsplit.protocol import write_weights

from fedsplit import aggregation
from tests._helpers.weight_files import opened

RULES = [
    ("fedavg", {}),
    ("median", {}),
    ("median", {"weighted": True}),
    ("trimmed-mean", {"beta": 0.2}),
    ("trimmed-mean", {"beta": 0.25, "weighted": True}),
    ("krum", {"f": 1}),
    ("multi-krum", {"f": 1}),
    ("geometric-median", {}),
]
#: rules whose aggregate is the same bits on the device (sorted ranks, Krum's choice)
EXACT = {("median", False), ("krum", False)}


def _check(h, device, tmp_path: Path) -> None:
    for dtype in (np.float16, np.float32, np.float64):
        rng = np.random.default_rng(7)
        ws = h.random_weights(rng, 9, dtype, shapes=[(40, 3), (), (7,)])
        updates = h.as_updates(ws, [int(c) for c in rng.integers(1, 60, size=9)])
        paths = [write_weights(u, tmp_path / f"{dtype.__name__}-{u.site}.h5") for u in updates]
        for name, params in RULES:
            strat = aggregation.get_strategy(name, params)
            ref = aggregation.aggregate_updates(
                strat, updates, settings=BackendSettings(mode="numpy", device="cpu"))
            budget = 9 * 64 * 30 + 4096  # several blocks per parameter
            with opened(paths) as files:
                got = aggregation.aggregate_updates(
                    strat, files, settings=BackendSettings(mode="numpy", device=device),
                    memory_budget=budget,
                )
            assert got.report.working_bytes <= budget
            exact = (name, bool(params.get("weighted"))) in EXACT and dtype != np.float16
            for key, want in ref.arrays.items():
                have = got.arrays[key]
                assert have.dtype == want.dtype
                if exact:
                    np.testing.assert_array_equal(have, want, err_msg=name)
                else:
                    tol = {np.float16: 1e-3, np.float32: 2e-6, np.float64: 1e-12}[dtype]
                    if name == "geometric-median":
                        tol = max(tol, 1e-5)
                    np.testing.assert_allclose(have, want, rtol=tol, atol=tol, err_msg=name)
            for a, b in zip(ref.report.sites, got.report.sites, strict=True):
                assert a.selected == b.selected
                assert b.l2_to_aggregate == pytest.approx(a.l2_to_aggregate, rel=1e-4, abs=1e-4)
                if a.trimmed_fraction is not None and name != "median":
                    assert b.trimmed_fraction == pytest.approx(a.trimmed_fraction, abs=1e-9)


def test_torch_path_on_the_cpu_matches_the_reference(h, tmp_path: Path) -> None:
    """The GPU code, run by torch on the CPU, from weight files under a small budget."""
    pytest.importorskip("torch")
    _check(h, TorchDevice("cpu"), tmp_path)


def test_cuda_matches_the_reference(h, tmp_path: Path) -> None:
    """The same on the machine's GPU (skipped where torch sees none)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    _check(h, "cuda", tmp_path)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "", "tpu:0"])
def test_bad_device_names_are_refused(spec) -> None:
    with pytest.raises(AggregationError, match="Received:"):
        resolve(spec or "cuda0")


def test_cuda_without_a_gpu_is_refused_and_auto_falls_back(h) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(AggregationError, match="torch sees none"):
        resolve("cuda")
    assert resolve("auto").device is None and resolve("cpu").device is None


def test_auto_on_a_cpu_machine_does_not_import_torch(tmp_path: Path) -> None:
    """``device="auto"`` decides without torch when the machine has no NVIDIA driver."""
    if Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidia0").exists():
        pytest.skip("this machine has an NVIDIA driver: auto imports torch to ask it")
    code = (
        "import sys, numpy as np\n"
        "from fedsplit import aggregation\n"
        "from fedsplit.protocol import Update\n"
        "ups = [Update({'a': np.full(3, k, np.float32)}, num_examples=1, site=f's{k}') "
        "for k in range(3)]\n"
        "r = aggregation.aggregate_updates(aggregation.get_strategy('median'), ups)\n"
        "assert r.arrays['a'].tolist() == [1, 1, 1]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(aggregation.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
