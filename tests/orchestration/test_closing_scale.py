"""`fedsplit simulate`'s closing analyses grow linearly with the hospitals (issue 43): the
baselines are a choice (``--baselines``), each is scored in O(hospitals), and a large
federation's per-hospital table goes to a file while the console shows its spread."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fedsplit.client.data import Dataset
from fedsplit.client.site import split_site
from fedsplit.orchestration import experiment
from fedsplit.orchestration.experiment import (
    CROSS_SCORED_SITES,
    Experiment,
    check_schema,
    encode_sites,
    parse_baselines,
    prepare_tables,
    train_baselines,
)
from fedsplit.orchestration.tables import (
    CONSOLE_SITES,
    models_table,
    summary_tables,
    write_site_table,
)
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, HospitalFailure
from fedsplit.protocol.record.summary import RunSummary, Scores
from rich.console import Console


def test_baselines_choice_parses_auto_none_and_a_list() -> None:
    assert parse_baselines("auto") is None
    assert parse_baselines("none") == ()
    assert parse_baselines("centralized") == ("centralized",)
    assert parse_baselines("local, centralized,local") == ("local", "centralized")
    for bad in ("", "central", "none,local", "auto,local"):
        with pytest.raises(ConfigError, match="--baselines is auto"):
            parse_baselines(bad)


def federation(sites: int, tmp_path: Path, cfg: RunConfig
               ) -> tuple[dict[str, tuple[Dataset, Dataset]], list[tuple[str, Dataset]]]:
    """breast-cancer split across ``sites`` hospitals: each one's (training, validation) rows
    and its test patients, encoded as the closing encodes them."""
    tables = prepare_tables(Experiment(cfg=cfg, out=tmp_path, dataset="breast-cancer",
                                       num_sites=sites))
    checked = check_schema(tables, cfg)
    pairs = encode_sites(tables, checked[0] if checked else None)
    splits = {t.name: split_site(train, cfg.val_fraction, cfg.seed)
              for t, (train, _) in zip(tables, pairs, strict=True)}
    return splits, [(t.name, test) for t, (_, test) in zip(tables, pairs, strict=True)]


@pytest.fixture
def scored(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The hospitals whose test patients each `experiment.evaluate` call scores (the real
    function runs; its calls are recorded)."""
    calls: list[list[str]] = []
    real = experiment.evaluate

    def counted(model, tests: Sequence[tuple[str, Dataset]], local=None) -> Scores:
        calls.append([name for name, _ in tests])
        return real(model, tests, local)

    monkeypatch.setattr(experiment, "evaluate", counted)
    return calls


CFG = RunConfig(num_server_rounds=1, local_steps=1, seed=0)


@pytest.mark.parametrize("choice", ["none", "centralized", "local", "centralized,local"])
def test_baselines_are_trained_as_chosen_and_scored_in_linear_time(
        choice: str, tmp_path: Path, scored: list[list[str]]) -> None:
    sites = CROSS_SCORED_SITES + 5  # above the cut: a hospital alone on its own patients only
    splits, tests = federation(sites, tmp_path, CFG)
    wanted = parse_baselines(choice)
    centralized, alone, failures = train_baselines(wanted, splits, tests, CFG, num_outputs=2)
    assert not failures
    names = [name for name, _ in tests]
    assert (centralized is not None) == ("centralized" in wanted)
    assert [b.site for b in alone] == (names if "local" in wanted else [])
    if centralized is not None:  # on every hospital's patients, once
        assert list(centralized.per_site) == names
    for entry in alone:  # each on its own patients: pooled = its own
        assert list(entry.per_site) == [entry.site]
        assert entry.metrics == entry.per_site[entry.site]
    # one scoring of the centralized model on N test sets and one per hospital alone: 2N, not N^2
    assert sum(len(call) for call in scored) == sites * len(wanted)
    assert len(scored) == (1 if "centralized" in wanted else 0) + len(alone)


def test_a_small_federation_still_scores_each_hospital_alone_on_every_hospital(
        tmp_path: Path, scored: list[list[str]]) -> None:
    splits, tests = federation(3, tmp_path, CFG)
    said: list[str] = []  # what the progress bar shows while the closing runs
    _, alone, _ = train_baselines(("local", "centralized"), splits, tests, CFG, num_outputs=2,
                                  on_phase=said.append)
    names = [name for name, _ in tests]
    assert [list(b.per_site) for b in alone] == [names] * 3
    assert scored == [names] * 4  # the centralized model, then each hospital alone
    assert said[0].startswith("centralized baseline: ") and "3 hospitals' rows" in said[0]
    assert said[1:] == [f"hospital-alone baselines: {k} of 3" for k in (1, 2, 3)]


def summary_of(sites: int, *, cross: bool) -> RunSummary:
    names = [f"site-{i}" for i in range(sites)]

    def scores(base: float, who: Sequence[str]) -> dict:
        per_site = {n: {"accuracy": base + i / 10_000} for i, n in enumerate(who)}
        return {"metrics": {"accuracy": base}, "per_site": per_site,
                "mean_per_site": {"accuracy": base}}

    return RunSummary.from_json({
        "task": "classification", "strategy": "fedavg", "config": {"num-server-rounds": 3},
        "test_examples_per_site": {n: 10 + i for i, n in enumerate(names)},
        "test_examples": sum(10 + i for i in range(sites)),
        "centralized": {**scores(0.9, names), "num_examples": 100},
        "local_only": [{**scores(0.5 + i / 1000, names if cross else [n]), "site": n,
                        "num_examples": 7} for i, n in enumerate(names)],
        "federated": {**scores(0.8, names), "num_examples": 100},
    })


def rendered(tables: list) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=100)
    for table in tables:
        console.print(table)
    return buffer.getvalue()


def test_a_large_federation_writes_its_hospitals_to_a_file_and_prints_their_spread(
        tmp_path: Path) -> None:
    sites = CONSOLE_SITES + 30
    summary = summary_of(sites, cross=False)
    path = write_site_table(summary, tmp_path / "per_site.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["hospital"] for r in rows] == [f"site-{i}" for i in range(sites)]
    assert rows[3]["test_patients"] == "13"
    assert float(rows[3]["alone:accuracy"]) == pytest.approx(0.503)  # its own model, own rows
    assert float(rows[3]["centralized:accuracy"]) == pytest.approx(0.9003)
    assert float(rows[3]["federated:accuracy"]) == pytest.approx(0.8003)
    text = rendered(summary_tables(summary, path))
    assert "site-7 " not in text and "site-7\n" not in text  # no row per hospital
    assert f"over {sites} hospitals" in text and str(path) in "".join(text.split())  # wrapped
    # models: one row for the hospitals alone (their own scores' mean), not one each
    assert f"each hospital alone ({sites}, own test)" in text
    assert "site-0 alone" not in text
    own_mean = sum(0.5 + i / 1000 for i in range(sites)) / sites
    assert f"{own_mean:.3f}" in text


def test_a_small_federation_prints_a_row_per_hospital_and_per_model() -> None:
    summary = summary_of(4, cross=True)
    text = rendered(summary_tables(summary))
    for i in range(4):
        assert f"site-{i} (1{i})" in text and f"site-{i} alone" in text
    assert "each hospital alone" not in rendered([models_table(summary)])


def test_a_baseline_not_trained_has_no_column() -> None:
    summary = summary_of(3, cross=True).model_copy(update={"centralized": None, "local_only": []})
    text = rendered(summary_tables(summary))
    assert "centralized" not in text and "alone" not in text and "federated" in text


BOTH = ("centralized", "local")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the centralized baseline trains beside "
                                                      "the others only on a second core")
@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_the_centralized_baseline_trained_beside_equals_the_one_trained_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above `BESIDE_MIN_SITES` hospitals the centralized baseline trains in a spawned process
    while the hospital-alone ones train here: the same weights, selection and scores."""
    sites = experiment.BESIDE_MIN_SITES + 3
    cfg = RunConfig(num_server_rounds=2, local_steps=1, seed=0)
    splits, tests = federation(sites, tmp_path, cfg)
    said: list[str] = []
    beside, alone, failures = train_baselines(BOTH, splits, tests, cfg, num_outputs=2,
                                              on_phase=said.append)
    assert not failures and beside is not None
    assert "on another core" in said[0] and said[-1].startswith("centralized baseline: waiting")
    monkeypatch.setattr(experiment, "beside_locals", lambda *_: False)
    here, alone_here, _ = train_baselines(BOTH, splits, tests, cfg, num_outputs=2)
    assert here is not None
    assert beside.model_dump() == here.model_dump()
    assert [b.model_dump() for b in alone] == [b.model_dump() for b in alone_here]
    assert not experiment.beside_locals(BOTH, experiment.BESIDE_MIN_SITES, None)  # few: here
    assert not experiment.beside_locals(("centralized",), sites, None)  # nothing to overlap


def test_a_centralized_baseline_failing_beside_is_named_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's failure comes back as the same one-line `HospitalFailure` as here (the
    worker in a thread: the spawned process is the test above's)."""
    monkeypatch.setattr(experiment, "ProcessPoolExecutor",
                        lambda workers, mp_context: ThreadPoolExecutor(workers))
    monkeypatch.setattr(experiment, "beside_locals", lambda *_: True)
    sites = experiment.BESIDE_MIN_SITES + 1
    splits, tests = federation(sites, tmp_path, CFG)
    name = next(iter(splits))
    train, val = splits[name]
    splits[name] = (train, Dataset(val.x[:, :-1], val.y, val.task, val.kind,
                                   val.feature_names[:-1]))  # a column short: scoring fails
    centralized, alone, failures = train_baselines(BOTH, splits, tests, CFG, num_outputs=2)
    assert centralized is None and len(alone) == sites - 1
    assert failures[-1].startswith("the centralized baseline, training: ")
    assert "\n" not in failures[-1]
    parts = experiment._train_beside("the centralized baseline", train,
                                     [val for _, val in splits.values()], 2, CFG, 1)
    assert str(HospitalFailure(*parts)) == failures[-1]
