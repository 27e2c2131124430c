"""Hospital-level DP runs on the backend's operations and reports its working memory
(issue 34, item 5): the same clipped, count-weighted, noised mean as the float64 formula of
`aggregation.hospital_dp`'s docstring, on every CPU backend."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.aggregation import _compiled, backend
from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, HospitalDPParams, is_trained
from fedsplit.protocol.update import Update

from fedsplit import aggregation

SHAPES = {"fc1.weight": (64, 32), "fc1.bias": (64,), "fc2.weight": (3, 64), "fc2.bias": (3,),
          "norm.mean": (32,)}


def _round(seed: int = 0) -> tuple[dict[str, np.ndarray], list[Update]]:
    rng = np.random.default_rng(seed)
    ref = {k: rng.normal(0, 1, s).astype(np.float32) for k, s in SHAPES.items()}
    # changes of norm about 0.1 .. 1.6: some clipped at C = 0.5, some not
    ups = [Update(arrays={k: (v + rng.normal(0, 0.002 * 2 ** i, v.shape)).astype(np.float32)
                          for k, v in ref.items()}, num_examples=int(n), site=f"s{i}")
           for i, n in enumerate((40, 10, 300, 75, 5))]
    return ref, ups


def _formula(ref: dict[str, np.ndarray], ups: list[Update], clip: float
             ) -> tuple[dict[str, np.ndarray], list[float]]:
    """The docstring's z without noise, in float64: g + sum_k (n_k / N) d_k."""
    counts = np.array([u.num_examples for u in ups], np.float64)
    shares = counts / counts.sum()
    trained = [k for k in ref if is_trained(k)]
    norms = [float(np.sqrt(sum(np.sum((u.arrays[k].astype(np.float64) - ref[k]) ** 2)
                               for k in trained))) for u in ups]
    out = {}
    for k, g in ref.items():
        g64 = g.astype(np.float64)
        out[k] = g64 if not is_trained(k) else g64 + sum(
            p * min(1.0, clip / n) * (u.arrays[k].astype(np.float64) - g64)
            for p, n, u in zip(shares, norms, ups, strict=True))
    return out, norms


@pytest.mark.parametrize("mode", ["numpy", "compiled", "auto"])
def test_equals_the_float64_formula_on_every_cpu_backend(mode: str) -> None:
    if mode == "compiled" and _compiled.missing("weighted_sum") is not None:
        pytest.skip("no C compiler here for the compiled kernels")
    ref, ups = _round()
    rule = HospitalDPFedAvg(HospitalDPParams(clip=0.5, sigma=0.0))
    rule.set_reference(ref)
    result = aggregation.aggregate_updates(rule, ups, settings=aggregation.BackendSettings(mode=mode))
    want, norms = _formula(ref, ups, 0.5)
    assert 0 < result.report.details["clipped"] < len(ups)  # both cases present
    np.testing.assert_allclose(result.report.details["update_norms"], norms, rtol=1e-6)
    for k, w in want.items():
        got = result.arrays[k]
        assert got.dtype == np.float32
        # float32 products in the backend's pass (as FedAvg's), the weights summing to 1:
        # within 4 float32 ulp of the coordinate's largest input (|g| or any |w_k|)
        scale = np.max([np.abs(ref[k]), *(np.abs(u.arrays[k]) for u in ups)], axis=0)
        assert np.all(np.abs(got - w) <= 4 * np.spacing(scale)), k
    np.testing.assert_array_equal(result.arrays["norm.mean"], ref["norm.mean"])
    assert result.report.working_bytes is not None and result.report.working_bytes > 0


def test_the_noise_is_the_seeded_gaussian_in_model_order() -> None:
    ref, ups = _round(1)
    exact = HospitalDPFedAvg(HospitalDPParams(clip=0.5, sigma=0.0))
    exact.set_reference(ref)
    noisy = HospitalDPFedAvg(HospitalDPParams(clip=0.5, sigma=1.1), seed=7)
    noisy.set_reference(ref)
    a = aggregation.aggregate_updates(exact, ups)
    b = aggregation.aggregate_updates(noisy, ups)
    std = b.report.details["noise_std"]
    assert std == pytest.approx(1.1 * 0.5 * 300 / 430)
    draws = np.random.default_rng(7)
    for k in SHAPES:
        if not is_trained(k):
            assert np.array_equal(b.arrays[k], ref[k])
            continue
        noise = draws.normal(0.0, std, size=SHAPES[k])
        np.testing.assert_allclose(b.arrays[k], a.arrays[k] + noise, atol=4e-6)


def test_runs_on_the_backend_passes_and_reports_their_memory(monkeypatch) -> None:
    calls: list[tuple[str, tuple[str, ...]]] = []
    passes = {}
    for name in ("weighted_sum", "squared_distances"):
        real = getattr(backend, name)

        def spy(updates, *args, _real=real, _name=name, **kw):
            calls.append((_name, updates[0].header.names))
            passes[_name] = out = _real(updates, *args, **kw)
            return out

        monkeypatch.setattr(backend, name, spy)
    ref, ups = _round(2)
    rule = HospitalDPFedAvg(HospitalDPParams(clip=0.5, sigma=1.0), seed=0)
    rule.set_reference(ref)
    result = rule.aggregate(ups, memory_budget=1 << 20)
    trained = tuple(k for k in SHAPES if is_trained(k))
    assert calls == [("squared_distances", trained), ("weighted_sum", trained)]
    largest = max(int(np.prod(SHAPES[k])) for k in trained)
    assert result.report.working_bytes == max(passes["squared_distances"].working_bytes,
                                              passes["weighted_sum"].working_bytes,
                                              2 * 8 * largest)
    assert result.report.memory_budget == 1 << 20
