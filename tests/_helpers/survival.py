"""Checks shared by the survival tests."""

from __future__ import annotations

import numpy as np
from lifelines import KaplanMeierFitter


def assert_km_is_lifelines(times: np.ndarray, events: np.ndarray, curve_times: np.ndarray,
                           survival: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> None:
    """A Kaplan-Meier curve (its event times, survival and 95% band) equals lifelines' fit of the
    pooled ``times`` and ``events`` at every event time."""
    events = np.asarray(events, dtype=bool)
    ref = KaplanMeierFitter().fit(times, events)
    event_times = np.unique(np.asarray(times)[events])
    np.testing.assert_array_equal(curve_times, event_times)
    np.testing.assert_allclose(survival, ref.survival_function_.loc[event_times].iloc[:, 0],
                               rtol=1e-12)
    band = ref.confidence_interval_.loc[event_times]
    np.testing.assert_allclose(lower, band.iloc[:, 0], rtol=1e-10)
    np.testing.assert_allclose(upper, band.iloc[:, 1], rtol=1e-10)
