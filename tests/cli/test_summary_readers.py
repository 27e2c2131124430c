"""The readers of summary.json and privacy.json go through the models (issue 34, item 2): the
plots, ``fedsplit simulate``'s printout and ``fedsplit privacy-audit``'s table, fed files written
by the code before the models were the writer (tests/protocol/data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fedsplit.cli import simulate as simulate_cli
from fedsplit.cli.app import app
from fedsplit.orchestration import privacy_audit as audit_mod
from fedsplit.orchestration.experiment import load_summary
from fedsplit.orchestration.plots import plot_comparison, plot_rounds, plot_vertical
from fedsplit.protocol.record.privacy import AuditResult
from fedsplit.protocol.record.summary import RunSummary
from fedsplit.protocol.record.vertical import VerticalSummary
from typer.testing import CliRunner

DATA = Path(__file__).parents[1] / "protocol" / "data"
SUMMARIES = sorted(p.name for p in DATA.glob("summary-v*.json"))


@pytest.mark.parametrize("name", SUMMARIES)
def test_plots_and_printout_read_the_model(name: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    summary = load_summary(DATA / name)
    assert isinstance(summary, RunSummary)
    plot_rounds(summary, tmp_path / "rounds.png")
    assert (tmp_path / "rounds.png").read_bytes()[:4] == b"\x89PNG"
    plot_comparison({"a": summary, "b": summary}, tmp_path / "comparison.png", "two")
    assert (tmp_path / "comparison.png").stat().st_size > 0
    simulate_cli.print_summary(summary)
    out = capsys.readouterr().out
    assert summary.centralized is None or "centralized" in out
    if summary.personalized is not None and summary.personalized.prior_test:
        adopted = [n for n, t in summary.personalized.prior_test.items() if t.adopted]
        assert all(f"{n} refitted" in out.replace("\n", " ") for n in adopted)


def test_the_vertical_plot_reads_its_model(tmp_path: Path) -> None:
    data = json.loads((DATA / "vertical-simulate-summary-v1.json").read_text())
    plot_vertical(data, tmp_path / "a.png")
    plot_vertical(VerticalSummary.from_json(data), tmp_path / "b.png")
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0


def test_privacy_audit_prints_the_typed_result(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    result = AuditResult.load(DATA / "privacy-v2-simulate-dp.json")
    monkeypatch.setattr(audit_mod, "privacy_audit", lambda run_dir, references: result)
    out = CliRunner().invoke(app, ["privacy-audit", str(tmp_path)])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert result.headline is not None and result.worst_site is not None
    assert f"{result.headline.auc:.3f}" in text and f"worst hospital {result.worst_site.site}" in text
    for name, group in result.per_site.items():
        assert name in text and f"{group.members} / {group.non_members}" in text


def test_add_privacy_writes_the_brief_audit_through_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DP run's summary without its privacy section gets it back as the old code wrote it."""
    old = json.loads((DATA / "summary-v2-simulate-dp-audit.json").read_text())
    history = (DATA / "history-v1-dp.json").read_text()  # the same budget, two sites
    (tmp_path / "federation").mkdir()
    (tmp_path / "federation" / "history.json").write_text(history)
    RunSummary.from_json({k: v for k, v in old.items() if k != "privacy"}).save(
        tmp_path / "summary.json")
    result = AuditResult.load(DATA / "privacy-v2-simulate-dp.json")
    monkeypatch.setattr(audit_mod, "privacy_audit", lambda run_dir, references: result)
    summary = audit_mod.add_privacy(tmp_path, audit=True)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == summary.to_json()
    assert written["privacy"]["audit"] == old["privacy"]["audit"]
    assert {k: written["privacy"][k] for k in ("dp", "level", "epsilon_budget", "delta")} == {
        k: old["privacy"][k] for k in ("dp", "level", "epsilon_budget", "delta")}
    assert set(written["privacy"]["per_site"]) == set(old["privacy"]["per_site"])
