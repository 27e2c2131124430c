"""``fedsplit aggregate`` with robust rules: report beside the model, exclusions, caps, budget."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from fedsplit.cli.aggregate import parse_bytes
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol import ConfigError, Update, read_weights, write_weights
from fedsplit.protocol.errors import AggregationError


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """Five sites; h5 sends NaN weights, h4 claims far more rows than its cohort."""
    rng = np.random.default_rng(3)
    paths = []
    for i, n in enumerate([100, 120, 90, 5000, 110]):
        u = Update({"fc.weight": rng.normal(size=(3, 4)).astype(np.float32),
                    "fc.bias": rng.normal(size=3).astype(np.float32)},
                   num_examples=n, site=f"h{i + 1}")
        paths.append(write_weights(u, tmp_path / f"h{i + 1}.h5"))
    with h5py.File(paths[4], "r+") as f:
        f["arrays/fc.bias"][1] = np.nan
    return paths


def test_median_run_excludes_nan_clips_cap_and_saves_report(files, tmp_path, capsys) -> None:
    """NaN file excluded (not fatal), cap clipped and flagged, report printed and saved."""
    out = tmp_path / "global.h5"
    code = run_guarded(app, ["aggregate", *map(str, files), "-o", str(out), "--strategy",
                             "median", "--param", "weighted=true", "--cohort-cap", "h4=150",
                             "--memory-budget", "1MB"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "excluded h5: values: parameter 'fc.bias' holds 1 NaN/Inf value(s)" in printed
    assert "150 (claimed" in printed
    report = json.loads((tmp_path / "global.report.json").read_text())
    sites = {s["site"]: s for s in report["sites"]}
    assert sites["h5"]["excluded"] and sites["h4"]["num_examples"] == 150
    assert sites["h4"]["claimed_examples"] == 5000
    assert sites["h4"]["flags"] == ["count 5000 clipped to cohort cap 150"]
    assert report["memory_budget"] == 2**20 and report["working_bytes"] <= 2**20
    assert all(s["l2_to_aggregate"] is not None for s in report["sites"] if not s["excluded"])
    assert read_weights(out).num_examples == 100 + 120 + 90 + 150


def test_refuse_policy_and_reference_model(files, tmp_path, capsys) -> None:
    """--cap-policy refuse excludes h4; --reference fixes the layout; Krum reports selection."""
    ref = tmp_path / "round.h5"
    write_weights(read_weights(files[0]), ref)
    out = tmp_path / "g.h5"
    code = run_guarded(app, ["aggregate", *map(str, files), "-o", str(out), "--strategy", "krum",
                             "--param", "f=0", "--cohort-cap", "h4=150", "--cap-policy", "refuse",
                             "--reference", str(ref), "--report-json", str(tmp_path / "r.json")])
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [s["excluded"] for s in report["sites"]] == [False, False, False, True, True]
    assert sum(bool(s["selected"]) for s in report["sites"]) == 1
    assert "selected" in capsys.readouterr().out


def test_too_few_for_krum_and_bad_options_are_clear(files, tmp_path, capsys) -> None:
    """Krum f=1 on 4 usable files: exit 3 naming 2f+3; bad budget/cap/policy: exit 2."""
    out = str(tmp_path / "g.h5")
    code = run_guarded(app, ["aggregate", *map(str, files), "-o", out, "--strategy", "krum"])
    assert code == AggregationError.exit_code
    assert "2f+3 = 5" in capsys.readouterr().err
    for extra, fragment in [(["--memory-budget", "lots"], "Received: 'lots'"),
                            (["--cohort-cap", "h1"], "SITE=ROWS"),
                            (["--cap-policy", "drop"], "Received: 'drop'")]:
        assert run_guarded(app, ["aggregate", str(files[0]), "-o", out, *extra]) == 2
        assert fragment in capsys.readouterr().err


def test_parse_bytes_units() -> None:
    """Binary units; a bare number is bytes."""
    assert parse_bytes("512MB") == 512 * 2**20
    assert parse_bytes("1.5g") == int(1.5 * 2**30)
    assert parse_bytes("2048") == 2048
    with pytest.raises(ConfigError, match="Received: '-1MB'"):
        parse_bytes("-1MB")


def test_device_option_runs_on_the_cpu_and_refuses_bad_names(files, tmp_path, capsys) -> None:
    """``--device cpu`` gives the same model as the default; an unknown device is refused."""
    outs = []
    for device in ("cpu", "auto"):
        out = tmp_path / f"{device}.h5"
        code = run_guarded(app, ["aggregate", *map(str, files[:4]), "-o", str(out), "--strategy",
                                 "trimmed-mean", "--device", device])
        assert code == 0
        outs.append(read_weights(out))
    for key, arr in outs[0].arrays.items():
        np.testing.assert_array_equal(outs[1].arrays[key], arr)
    capsys.readouterr()
    code = run_guarded(app, ["aggregate", *map(str, files[:4]), "-o", str(tmp_path / "x.h5"),
                             "--device", "gpu0"])
    assert code == AggregationError.exit_code
    assert "Received: 'gpu0'" in capsys.readouterr().err
