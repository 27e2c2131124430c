"""The compiled backend against the numpy reference, and the backend switch (`BackendSettings`).

Every rule runs twice on the same random updates, once with ``FEDSPLIT_AGG_BACKEND=numpy``
(the reference) and once with ``=compiled`` (C and numba kernels for every pass whatever its
size); the bounds asserted are the ones docs/aggregation.md ("Backends") documents.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation._compiled import batcher_network, selection_network
from fedsplit.aggregation.errors import AggregationError
from fedsplit.aggregation.settings import BackendSettings
from fedsplit.protocol import write_weights

from fedsplit import aggregation
from tests._helpers.weight_files import opened

pytest.importorskip("numba")

RULES = [
    ("fedavg", {}),
    ("median", {}),
    ("median", {"weighted": True}),
    ("trimmed-mean", {"beta": 0.2}),
    ("trimmed-mean", {"beta": 0.34}),
    ("trimmed-mean", {"beta": 0.25, "weighted": True}),
    ("krum", {"f": 1}),
    ("multi-krum", {"f": 1}),
    ("geometric-median", {}),
]
SHAPES = [(70, 3), (), (5,), (2, 3, 4)]


def _run(kernels: str, name: str, params: dict, updates, **kw):
    return aggregation.aggregate_updates(aggregation.get_strategy(name, params), updates,
                                         settings=BackendSettings(mode=kernels), **kw)


def _bound(ref: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """1 ulp of the output, plus the float64 sum-order bound 2 N eps max|x| (float64 models)."""
    spacing = np.spacing(np.abs(ref).astype(ref.dtype)).astype(np.float64)
    if ref.dtype == np.float64:
        spacing = spacing + 2 * n * np.finfo(np.float64).eps * float(np.max(np.abs(values)))
    return spacing


def _objective(z, updates) -> float:
    """The geometric median's objective sum_k n_k ||w_k - z|| over all arrays (float64)."""
    return sum(u.num_examples * np.sqrt(sum(
        np.sum((u.arrays[k].astype(np.float64) - z.arrays[k].astype(np.float64)) ** 2)
        for k in z.arrays)) for u in updates)


@pytest.mark.parametrize("name,params", RULES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_kernels_match_the_numpy_reference(h, monkeypatch, name, params, dtype) -> None:
    """Random cases (odd and even N, ties, 0-d parameters): same bits or within the bound."""
    # a stable seed per case (str hashes are salted per process: the cases would change per run)
    rng = np.random.default_rng(zlib.crc32(f"{name}|{params}|{np.dtype(dtype).name}".encode()))
    for case in range(8):
        n = int(rng.integers(5, 14)) if "krum" in name else int(rng.integers(1, 14))
        ties = case % 3 == 0
        ws = h.random_weights(rng, n, dtype, ties=ties, shapes=SHAPES)
        counts = [int(c) for c in rng.integers(1, 50, size=n)]
        if case % 4 == 1:
            counts = [7] * n  # equal counts: exact halves in the weighted median
        updates = h.as_updates(ws, counts)
        ref = _run("numpy", name, params, updates)
        got = _run("compiled", name, params, updates)
        for key, want in ref.arrays.items():
            have = got.arrays[key]
            assert have.dtype == want.dtype and have.shape == want.shape
            exact = name in ("fedavg", "krum", "multi-krum") or (
                name == "median" and not params.get("weighted")
            ) or (name == "trimmed-mean" and not params.get("weighted") and n - 2 * int(
                params["beta"] * n) <= 2)
            if exact or dtype == np.float16:  # float16 models stay on the numpy path
                np.testing.assert_array_equal(have, want, err_msg=f"{name} N={n} case {case}")
            elif name == "geometric-median":
                # both are eps-approximate minimisers of g(z) = sum_k n_k ||w_k - z||: the
                # stopping rule bounds the objective, not each coordinate
                scale = max(float(np.max(np.abs(want))), 1.0)
                np.testing.assert_allclose(have, want, rtol=1e-3, atol=1e-3 * scale)
                assert _objective(got, updates) == pytest.approx(_objective(ref, updates),
                                                                 rel=1e-4), (n, case)
            else:
                values = np.stack([u.arrays[key] for u in updates]).astype(np.float64)
                err = np.abs(have.astype(np.float64) - want.astype(np.float64))
                assert np.all(err <= _bound(want, values, n)), (name, n, case, err.max())
        for a, b in zip(ref.report.sites, got.report.sites, strict=True):
            assert a.selected == b.selected and a.weight == pytest.approx(b.weight, rel=1e-6)
            assert b.l2_to_aggregate == pytest.approx(a.l2_to_aggregate, rel=1e-5, abs=1e-6)
            if a.trimmed_fraction is not None and not ties:
                assert b.trimmed_fraction == pytest.approx(a.trimmed_fraction, abs=1e-9)


@pytest.mark.parametrize("name,params", RULES)
def test_kernels_hold_the_budget_and_read_files_alike(h, tmp_path: Path, monkeypatch, name, params):
    """Under a budget that cuts every parameter into many blocks, from weight files too."""
    updates = h.make_updates(9, shapes=[(6, 90), (4, 3, 5), (11,), ()], seed=5)
    budget = 80 if name in ("fedavg", "geometric-median") else 9 * 4 * 40 + 4096
    ref = _run("numpy", name, params, updates, memory_budget=budget)
    got = _run("compiled", name, params, updates, memory_budget=budget)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    with opened(paths) as files:
        from_files = _run("compiled", name, params, files, memory_budget=budget)
    assert got.report.working_bytes <= budget
    for key, want in ref.arrays.items():
        np.testing.assert_allclose(got.arrays[key], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(from_files.arrays[key], got.arrays[key])


@pytest.mark.parametrize("n", [*range(1, 40), 50, 64, 65, 100])
def test_selection_networks_sort_the_ranks_they_promise(n) -> None:
    """Batcher's network sorts every input; a pruned one still fixes the ranks asked for."""
    rng = np.random.default_rng(n)
    x = rng.integers(0, 5, size=(n, 400)).astype(np.float64)  # many ties
    x[:, :50] = rng.permuted(np.tile(np.arange(n)[:, None], (1, 50)), axis=0)
    want = np.sort(x, axis=0)
    for first, last in [(0, n - 1), ((n - 1) // 2, n // 2), (n // 5, n - n // 5 - 1)]:
        lo, hi = selection_network(n, first, last)
        y = x.copy()
        for a, b in zip(lo, hi, strict=True):
            y[a], y[b] = np.minimum(y[a], y[b]), np.maximum(y[a], y[b])
        np.testing.assert_array_equal(y[first : last + 1], want[first : last + 1])
    assert len(selection_network(n, (n - 1) // 2, n // 2)[0]) <= len(batcher_network(n))


def test_the_switch_refuses_unknown_values() -> None:
    with pytest.raises(AggregationError, match="Received: 'fast'"):
        BackendSettings.from_environ({"FEDSPLIT_AGG_BACKEND": "fast"})
    with pytest.warns(FutureWarning), pytest.raises(AggregationError, match="'fast'"):
        BackendSettings.from_environ({"FEDSPLIT_AGG_KERNELS": "fast"})


def test_the_old_variable_still_works_with_a_warning() -> None:
    """FEDSPLIT_AGG_KERNELS (replaced) is read when FEDSPLIT_AGG_BACKEND is unset; numba is
    its old name of compiled."""
    from fedsplit.aggregation import settings

    for old, new in (("numba", "compiled"), ("compiled", "compiled"), ("numpy", "numpy")):
        settings._warn_old.cache_clear()
        with pytest.warns(FutureWarning, match=f"FEDSPLIT_AGG_BACKEND={new}"):
            assert BackendSettings.from_environ({"FEDSPLIT_AGG_KERNELS": old}).mode == new
    both = {"FEDSPLIT_AGG_KERNELS": "numpy", "FEDSPLIT_AGG_BACKEND": "auto"}
    assert BackendSettings.from_environ(both).mode == "auto"  # the new variable wins


def test_kernels_work_from_a_read_only_install(tmp_path: Path) -> None:
    """No writable cache directory: the kernels are compiled in memory and still run."""
    src = Path(aggregation.__file__).parent / "_numba_kernels.py"
    pkg = tmp_path / "ro"
    pkg.mkdir()
    (pkg / "ro_kernels.py").write_text(src.read_text())
    cache = tmp_path / "cache"
    cache.mkdir()
    for p in (pkg / "ro_kernels.py", pkg, cache):
        p.chmod(stat.S_IREAD | stat.S_IEXEC | (0 if p.is_file() else stat.S_IXUSR))
    code = (
        "import numpy as np, ro_kernels as k\n"
        "x = np.array([[1, 2], [3, 6]], np.float32)\n"
        "k.center_columns(x, 0, 2)\n"
        "assert x.tolist() == [[-1, -2], [1, 2]], x\n"
        "print(type(k.center_columns._cache).__name__)\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "HOME": str(cache),
           "PYTHONPATH": str(pkg), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        for p in (pkg, cache):
            p.chmod(stat.S_IRWXU)
    assert done.returncode == 0, done.stderr[-2000:]


def test_select_follows_the_documented_policy() -> None:
    """auto: the streamed operations take the C kernels at any size (no start-up to pay for),
    the sorting ones numba's from COMPILED_FROM values, the Gram matrix stays in numpy (BLAS);
    numpy: neither; compiled: both always."""
    from fedsplit.aggregation import _ckernels, _compiled
    from fedsplit.aggregation.backend import STACKED, STREAMED
    from fedsplit.aggregation.settings import COMPILED_FROM, NUMPY_UNDER_AUTO

    assert isinstance(_compiled.c_kernels(), _ckernels.StreamedKernels)
    auto = BackendSettings(device="cpu")
    for op in STREAMED:
        assert auto.select(op, 10).name == "compiled"
    for op in STACKED:
        assert auto.select(op, COMPILED_FROM - 1).name == "numpy"  # small stacked passes: numpy
        assert auto.select(op, COMPILED_FROM).name == (
            "numpy" if op in NUMPY_UNDER_AUTO else "compiled")
    numpy_only = BackendSettings(mode="numpy", device="cpu")
    assert {numpy_only.select(op, 1 << 30).name for op in STREAMED + STACKED} == {"numpy"}
    compiled = BackendSettings(mode="compiled", device="cpu")
    assert {compiled.select(op, 1).name for op in STREAMED + STACKED} == {"compiled"}
    with pytest.raises(ValueError, match="Received: 'sort'"):
        auto.select("sort", 1)
