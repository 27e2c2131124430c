"""Hostile-site attacks: parsing with clear errors, exact definitions, robust rules resist them."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.client.attacks import Attack, hostile_sites, parse_attack
from fedsplit.protocol import ConfigError, Update

from fedsplit import aggregation


@pytest.mark.parametrize("text,expected", [
    ("signflip", Attack("signflip")), ("signflip:3", Attack("signflip", 3.0)),
    ("scale:10", Attack("scale", 10.0)), ("gaussian:0.5", Attack("gaussian", 0.5)),
    ("nan", Attack("nan")), ("LabelFlip", Attack("labelflip")), ("none", None), ("", None),
])
def test_parse_attack(text, expected) -> None:
    """Every documented form parses to the attack it names."""
    assert parse_attack(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("boil", "Unknown attack 'boil'"), ("scale", "needs a value after a colon"),
    ("scale:x", "finite number"), ("gaussian:-1", "> 0"), ("nan:3", "takes no value"),
    ("scale:0", "non-zero"), ("gaussian:inf", "finite number"),
])
def test_parse_attack_errors_say_what_and_end_with_received(text, fragment) -> None:
    """Bad strings: the problem, the fix, and the received text."""
    with pytest.raises(ConfigError, match=fragment) as err:
        parse_attack(text)
    assert str(err.value).endswith(f"Received: {text!r}")


def test_update_attacks_follow_their_definitions() -> None:
    """signflip g-K(w-g) (K=4 unless given), scale g+K(w-g), gaussian w+noise, nan all-NaN; dtype kept."""
    g = {"w": np.array([1.0, 2.0, 3.0], np.float32)}
    w = {"w": np.array([2.0, 2.0, 1.0], np.float32)}
    flip = parse_attack("signflip").poison_update(w, g)["w"]  # K=4 by default
    np.testing.assert_array_equal(flip, [-3.0, 2.0, 11.0])
    assert flip.dtype == np.float32
    np.testing.assert_array_equal(parse_attack("signflip:2").poison_update(w, g)["w"], [-1, 2, 7])
    np.testing.assert_array_equal(parse_attack("scale:10").poison_update(w, g)["w"], [11, 2, -17])
    noisy = parse_attack("gaussian:0.1").poison_update(w, g, seed=1)["w"]
    assert 0 < np.abs(noisy - w["w"]).max() < 1
    assert np.isnan(parse_attack("nan").poison_update(w, g)["w"]).all()
    np.testing.assert_array_equal(parse_attack("labelflip").poison_update(w, g)["w"], w["w"])


def test_labelflip_flips_classes_and_refuses_regression() -> None:
    """y -> C-1-y for classes; regression targets get a clear error."""
    y = np.array([0, 1, 2, 9])
    np.testing.assert_array_equal(parse_attack("labelflip").poison_labels(y, 10), [9, 8, 7, 0])
    np.testing.assert_array_equal(parse_attack("scale:3").poison_labels(y, 10), y)
    with pytest.raises(ConfigError, match="classification"):
        parse_attack("labelflip").poison_labels(np.array([0.5, 1.2]), 1)


def test_hostile_sites_are_the_last_m_and_bounds_are_checked() -> None:
    """M hostile of N: the last M; M must leave one honest site."""
    assert hostile_sites(5, 2) == [3, 4]
    assert hostile_sites(5, 0) == []
    with pytest.raises(ConfigError, match=r"0 to 4.*Received: 5"):
        hostile_sites(5, 5)


def test_robust_rules_resist_a_scaled_update_where_fedavg_does_not() -> None:
    """One of five sites sends scale:10: FedAvg moves far; median and trimmed mean barely do."""
    rng = np.random.default_rng(0)
    g = {"w": rng.standard_normal(200).astype(np.float32)}
    step = 0.1 * rng.standard_normal(200).astype(np.float32)  # the direction training agrees on
    honest = [{"w": g["w"] + step + 0.01 * rng.standard_normal(200).astype(np.float32)}
              for _ in range(5)]
    sent = [*honest[:4], parse_attack("scale:10").poison_update(honest[4], g)]
    updates = [Update(a, num_examples=100, site=f"s{i}") for i, a in enumerate(sent)]
    clean = np.mean([h["w"] for h in honest[:4]], axis=0)
    err = {}
    for name in ("fedavg", "median", "trimmed-mean"):
        agg = aggregation.aggregate_updates(aggregation.get_strategy(name), updates).arrays["w"]
        err[name] = float(np.linalg.norm(agg - clean))
    assert err["median"] < err["fedavg"] / 5 and err["trimmed-mean"] < err["fedavg"] / 5
