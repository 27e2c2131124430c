"""The hospital's privacy ledger (issue 40): a DP budget the hospital keeps itself, per data file,
across runs, restarts and whatever round numbers the coordinator claims."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest
import typer
from fedsplit.cli.site_ledger import ledger as ledger_command
from fedsplit.client.privacy.dpsgd import DPPlan, plan_noise
from fedsplit.client.privacy.ledger import LedgerAccount, compose_epsilon, ledger_view
from fedsplit.protocol.dp_ledger import LEDGER_FILE, PrivacyLedger
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import DPSpec, PrivacyBudgetError
from fedsplit.protocol.site_policy import DPBudget
from typer.testing import CliRunner

BUDGET = DPBudget(epsilon=1.0, delta=1e-5)


@lru_cache(maxsize=8)
def _plan(epsilon: float = 1.0, rounds: int = 5) -> DPPlan:
    """One run's plan: ``rounds`` rounds of 10 steps on 200 rows within ``epsilon``."""
    return plan_noise(DPSpec.parse(f"epsilon={epsilon},delta=1e-5", rounds=rounds), rows=200,
                      batch_size=32, steps_per_round=10)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "north.csv"
    path.write_text("age,y\n50,0\n61,1\n")
    return path


def _account(tmp_path: Path, data: Path, run: str, budget: DPBudget | None = BUDGET
             ) -> LedgerAccount:
    return LedgerAccount(tmp_path / "state", "north", data, run, budget)


def _try(account: LedgerAccount, plan: DPPlan, rounds: list[int]) -> list[float | str]:
    """Charge one training per claimed round: its epsilon, or the refusal's line."""
    out: list[float | str] = []
    for r in rounds:
        try:
            out.append(account.charge(plan, r))
        except PrivacyBudgetError as e:
            assert "\n" not in str(e) and "Received:" in str(e)
            out.append(str(e))
    return out


def _recorded(tmp_path: Path, data: Path) -> list:
    ledger = PrivacyLedger.read(tmp_path / "state" / LEDGER_FILE)
    return ledger.files[str(data.resolve())].trainings


def test_a_budget_of_one_holds_across_three_runs_on_the_same_file(tmp_path, data) -> None:
    """Three runs (three run ids), each planned to spend epsilon 1 in 5 rounds: the first
    spends it, the next two are refused by the hospital's budget; the file never passes 1."""
    plan = _plan()
    first = _try(_account(tmp_path, data, "run-1"), plan, [1, 2, 3, 4, 5])
    assert all(isinstance(e, float) for e in first) and 0.9 < first[-1] <= 1.0
    for run in ("run-2", "run-3"):
        refused = _try(_account(tmp_path, data, run), plan, [1, 2, 3, 4, 5])
        assert all(isinstance(e, str) for e in refused)
        assert "refuses to train" in refused[0] and "above the hospital's budget of 1" in refused[0]
        assert f"run {run}, round 1" in refused[0] and str(data.resolve()) in refused[0]
    trainings = _recorded(tmp_path, data)
    assert len(trainings) == 5 and {t.run_id for t in trainings} == {"run-1"}
    history = [(t.noise_multiplier, t.sample_rate, t.steps) for t in trainings]
    assert compose_epsilon(history, BUDGET.delta) <= BUDGET.epsilon
    assert trainings[-1].epsilon == pytest.approx(first[-1])


def test_smaller_runs_compose_across_runs_until_the_budget(tmp_path, data) -> None:
    """Runs of epsilon 0.4 each: the hospital's budget of 1 admits some of them, composed with
    Opacus's RDP accountant over every recorded training, then refuses mid-run."""
    plan = _plan(epsilon=0.4, rounds=3)
    results = [e for k in range(6) for e in _try(_account(tmp_path, data, f"run-{k}"), plan,
                                                 [1, 2, 3])]
    accepted = [e for e in results if isinstance(e, float)]
    assert 3 < len(accepted) < len(results) and accepted == sorted(accepted)
    assert max(accepted) <= 1.0 and any("hospital's budget" in str(e) for e in results)


def test_twenty_trainings_claiming_round_one_spend_no_more_than_planned(tmp_path, data) -> None:
    """The coordinator repeats 'round 1' twenty times: the run's own budget (epsilon 1 planned
    for 5 rounds) stops it after 5, counted by the hospital, with or without a hospital budget."""
    plan = _plan()
    for budget, run in ((None, "repeat"), (BUDGET, "repeat-with-budget")):
        folder = tmp_path / run
        account = LedgerAccount(folder, "north", data, run, budget)
        results = _try(account, plan, [1] * 20)
        assert sum(isinstance(e, float) for e in results) == 5
        assert ("the run's epsilon of 1, which caps the file's total" in str(results[5])
                or "hospital's budget" in str(results[5]))
        trainings = PrivacyLedger.read(folder / LEDGER_FILE).files[str(data.resolve())].trainings
        assert [t.round for t in trainings] == [1] * 5
        assert all(t.epsilon <= 1.0 for t in trainings)


def test_missing_and_reset_round_numbers_count_nothing(tmp_path, data) -> None:
    """No round (0, as the wire reads a missing one) and a reset (1..5, then 1..5 again): every
    training counts; the run's budget then the hospital's stop them."""
    plan = _plan()
    missing = _try(_account(tmp_path, data, "no-rounds", None), plan, [0] * 8)
    assert sum(isinstance(e, float) for e in missing) == 5
    reset = LedgerAccount(tmp_path / "reset", "north", data, "reset", None)
    results = _try(reset, plan, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5])
    assert sum(isinstance(e, float) for e in results) == 5
    assert "above the run's epsilon of 1, which caps the file's total" in str(results[5])
    # a new run on the same file (resume=false, a new --out): the hospital's budget remembers
    again = _try(LedgerAccount(tmp_path / "reset", "north", data, "fresh", BUDGET), plan, [1])
    assert "hospital's budget" in str(again[0])


_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from fedsplit.client.privacy.dpsgd import DPPlan
    from fedsplit.client.privacy.ledger import LedgerAccount
    from fedsplit.protocol.site_policy import DPBudget

    sigma, q, steps = float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
    plan = DPPlan(sigma, q, steps, rounds=5, epsilon=1.0, delta=1e-5, clip=1.0)
    account = LedgerAccount(Path(sys.argv[1]), "north", Path(sys.argv[2]), sys.argv[3],
                            DPBudget(epsilon=1.0, delta=1e-5))
    try:
        print(account.charge(plan, 1))
    except Exception as e:
        print(type(e).__name__)
""")


@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_the_ledger_survives_a_process_restart(tmp_path, data) -> None:
    """A new process (the agent restarted) reads what the previous one recorded."""
    plan = _plan()
    _try(_account(tmp_path, data, "run-1"), plan, [1, 2, 3])
    child = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD, str(tmp_path / "state"),
                            str(data), "run-2", repr(plan.noise_multiplier),
                            repr(plan.sample_rate), str(plan.steps_per_round)],
                           capture_output=True, text=True, timeout=120, check=True)
    one = (plan.noise_multiplier, plan.sample_rate, plan.steps_per_round)
    assert float(child.stdout.split()[-1]) == pytest.approx(compose_epsilon([one] * 4, 1e-5))
    trainings = _recorded(tmp_path, data)
    assert [t.run_id for t in trainings] == ["run-1"] * 3 + ["run-2"]
    # and this process, in turn, sees the child's training
    after = _try(_account(tmp_path, data, "run-1"), plan, [4, 5])
    assert isinstance(after[0], float) and isinstance(after[1], str)  # 5 in all, then refused


def _charge_once(folder: str, data: str, run: str, start) -> None:
    start.wait()
    LedgerAccount(Path(folder), "north", Path(data), run, None).charge(_plan(8.0, 50), 1)


def test_concurrent_trainings_are_recorded_once_each(tmp_path, data) -> None:
    """Six agent processes train at once: six trainings recorded, each epsilon a different
    point of the same composition (the lock serialises read, check and write)."""
    _plan(8.0, 50)  # planned once, before the processes fork
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(6)
    procs = [ctx.Process(target=_charge_once, args=(str(tmp_path / "state"), str(data),
                                                    f"run-{k}", start)) for k in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    trainings = _recorded(tmp_path, data)
    assert sorted(t.run_id for t in trainings) == [f"run-{k}" for k in range(6)]
    plan = _plan(8.0, 50)
    one = (plan.noise_multiplier, plan.sample_rate, plan.steps_per_round)
    assert sorted(t.epsilon for t in trainings) == pytest.approx(
        [compose_epsilon([one] * k, 1e-5) for k in range(1, 7)])


def test_a_damaged_ledger_stops_dp_training_instead_of_starting_over(tmp_path, data) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / LEDGER_FILE).write_text('{"format": "fedsplit.dp-ledger", "vers')
    with pytest.raises(ConfigError, match=r"ledger .* is damaged.*Received:"):
        _account(tmp_path, data, "run-1").charge(_plan(), 1)


def test_plain_trainings_are_counted_and_the_cli_shows_every_file(tmp_path, data) -> None:
    """`fedsplit site ledger --state-dir DIR`: trainings, runs, epsilon at the budget's delta,
    the budget, what is left, and the plain trainings."""
    plan = _plan()
    _try(_account(tmp_path, data, "run-1"), plan, [1, 2])
    _account(tmp_path, data, "run-2").record_plain(1)
    (view,) = ledger_view(tmp_path / "state")
    assert (view.trainings, view.runs, view.plain_trainings, view.budget) == (2, 1, 1, 1.0)
    assert view.left == pytest.approx(1.0 - view.epsilon)
    holder = typer.Typer()
    holder.command()(ledger_command)
    result = CliRunner().invoke(holder, ["--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith(str(data.resolve())))
    assert line.split()[1:] == ["2", "1", f"{view.epsilon:.4f}", "1e-05", "1", f"{view.left:.4f}",
                                "1"]
    raw = json.loads((tmp_path / "state" / LEDGER_FILE).read_text())
    assert raw["files"][str(data.resolve())]["sha256"] and raw["site"] == "north"
    with pytest.raises(ConfigError, match="holds no privacy ledger"):
        ledger_view(tmp_path)
