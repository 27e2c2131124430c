"""The hospital's privacy ledger: what each of its data files has spent, counted by the hospital.

Every DP-SGD training the hospital does is recorded in its ledger (`protocol.dp_ledger`: the
file format) before it starts, under a file lock and atomically, so that several ClientApp
processes training at once each count once and a crash never under-counts. The coordinator's
round number is written down as claimed and never counts: a repeated, missing or reset round,
a new run, ``resume=false`` or a new ``--out`` all find the trainings already recorded.

Epsilon composes with Opacus's ``RDPAccountant`` over every training recorded for the data file
(its ``history`` of (noise multiplier, sample rate, steps)), read at the hospital's budget's
delta (policy ``dp_budget``; without one, the run's delta). Before a training
(`LedgerAccount.charge`) the hospital refuses with `PrivacyBudgetError` when the history plus
this training would go above

- the hospital's budget for the file (policy ``dp_budget``), over every run; or
- the run's own budget (its ``dp`` spec's epsilon, at its delta), over this run's trainings of
  the file.

Plain (non-DP) trainings are counted (`LedgerAccount.record_plain`), never composed: their
epsilon is unbounded, and the policy's ``allow_plain_training`` governs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

from fedsplit.client.node_config import NodeConfig
from fedsplit.client.privacy.dpsgd import DPPlan
from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.dp_ledger import (
    LEDGER_FILE,
    LOCK_FILE,
    DataFileEntry,
    DPTraining,
    PrivacyLedger,
)
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import PrivacyBudgetError
from fedsplit.protocol.site_policy import DPBudget

#: Relative slack on a budget comparison (float sums of identical RDP terms).
_SLACK = 1e-9


def compose_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """Epsilon of ``history`` ((noise multiplier, sample rate, steps) per training) at ``delta``:
    Opacus's ``RDPAccountant`` over all of it; 0 for none.

    Trainings at the same noise and sample rate are handed to the accountant as one entry with
    their steps summed: the RDP of the subsampled Gaussian is linear in the steps, so the
    epsilon is the same, and a ledger of thousands of rounds composes in milliseconds."""
    if not history:
        return 0.0
    steps: dict[tuple[float, float], int] = {}
    for sigma, q, n in history:
        key = (float(sigma), float(q))
        steps[key] = steps.get(key, 0) + int(n)
    return _rdp_epsilon(tuple((sigma, q, n) for (sigma, q), n in steps.items()), float(delta))


@lru_cache(maxsize=256)
def _rdp_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Opacus's ``RDPAccountant`` with ``history``, read at ``delta`` (remembered: a ledger's
    "spent" is the previous training's "after")."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta=delta))


@dataclass(frozen=True)
class DataFile:
    """A data file as the ledger names it: its resolved path, size, mtime and sha256."""

    path: Path
    size: int
    mtime: float
    sha256: str


_HASHES: dict[tuple[str, int, int], str] = {}


def describe_file(path: str | Path, known: DataFileEntry | None = None) -> DataFile:
    """``path`` resolved, with its size, mtime and sha256 (hashed once per process and version of
    the file, and not again while the ledger's entry ``known`` names the same size and mtime:
    every message is a new process, and a large file would be read whole each time); a folder
    (a recipe's reader's data) is recorded with size 0 and no hash."""
    resolved = Path(path).resolve()
    try:
        st = resolved.stat()
    except OSError as e:
        raise ConfigError(f"The hospital's data file cannot be found for its privacy ledger "
                          f"({e.strerror or e}); check node config data-path. Received: "
                          f"{resolved}") from e
    if resolved.is_dir():
        return DataFile(resolved, 0, st.st_mtime, "")
    key = (str(resolved), st.st_size, st.st_mtime_ns)
    if (key not in _HASHES and known is not None and known.sha256 and known.size == st.st_size
            and known.mtime == st.st_mtime):
        _HASHES[key] = known.sha256
    if key not in _HASHES:
        digest = hashlib.sha256()
        with open(resolved, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return DataFile(resolved, st.st_size, st.st_mtime, _HASHES[key])


@contextlib.contextmanager
def locked_ledger(folder: Path, site: str = "") -> Iterator[PrivacyLedger]:
    """The ledger in ``folder``, held under an exclusive lock (``flock`` on `LOCK_FILE`, so
    every process and thread of the hospital waits its turn); what the block leaves in it is
    written back atomically when the block ends without error."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / LOCK_FILE, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            ledger = PrivacyLedger.read(folder / LEDGER_FILE)
            before = ledger.to_json()
            ledger.site = ledger.site or site
            yield ledger
            if ledger.to_json() != before:
                with atomic_path(folder / LEDGER_FILE) as tmp:
                    tmp.write_text(ledger.to_json(), encoding="utf-8")
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _entry(ledger: PrivacyLedger, data: DataFile) -> DataFileEntry:
    key = str(data.path)
    entry = ledger.files.get(key) or DataFileEntry(path=key)
    entry.size, entry.mtime, entry.sha256 = data.size, data.mtime, data.sha256
    ledger.files[key] = entry
    return entry


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class LedgerAccount:
    """One hospital's ledger, for one data file and one run: what its agent charges."""

    folder: Path  # the hospital's state folder
    site: str
    data: Path  # the data file (or folder) the node config names
    run_id: str
    budget: DPBudget | None  # the hospital's policy dp_budget

    def charge(self, plan: DPPlan, server_round: int) -> float:
        """Check and record one DP-SGD training of ``plan`` (one round's steps) before it runs;
        return the data file's epsilon after it (over every recorded training, at the
        hospital's budget's delta, else the run's). Raises `PrivacyBudgetError`, recording
        nothing, when it would go above the hospital's budget or the run's."""
        this = (plan.noise_multiplier, plan.sample_rate, plan.steps_per_round)
        with locked_ledger(self.folder, self.site) as ledger:
            data = describe_file(self.data, ledger.files.get(str(Path(self.data).resolve())))
            entry = _entry(ledger, data)
            entry.budget = self.budget
            history = entry.history()
            # Without a dp_budget in the hospital's policy, the run's epsilon caps the file's
            # total over every run: a new run, a reset or a resume never starts at zero.
            budget = self.budget or DPBudget(epsilon=plan.epsilon, delta=plan.delta)
            limit = (f"the hospital's budget of {budget.epsilon:g}" if self.budget is not None
                     else f"the run's epsilon of {budget.epsilon:g}, which caps the file's total "
                          f"over every run while the hospital's policy sets no dp_budget")
            delta = budget.delta
            spent, after = compose_epsilon(history, delta), compose_epsilon([*history, this], delta)
            where = (f"run {self.run_id}, round {server_round} as the coordinator claimed it; "
                     f"noise {plan.noise_multiplier:.4g}, sample rate {plan.sample_rate:.4g}, "
                     f"{plan.steps_per_round} steps")
            if after > budget.epsilon * (1 + _SLACK):
                raise PrivacyBudgetError(
                    f"Hospital {self.site} refuses to train on {data.path}: its patients have "
                    f"spent epsilon {spent:.4f} (delta {delta:g}) over {len(history)} DP-SGD "
                    f"trainings in {len(entry.runs())} run(s), and this training would cost "
                    f"{after - spent:.4f} more ({after:.4f}), above {limit}; "
                    f"{max(budget.epsilon - spent, 0.0):.4f} is left: the "
                    f"file trains no more under DP unless the hospital raises dp_budget in its "
                    f"policy file (fedsplit site ledger --state-dir {self.folder} lists every "
                    f"training). Received: {where}")
            mine = entry.history(self.run_id)
            run_spent = compose_epsilon(mine, plan.delta)
            run_after = compose_epsilon([*mine, this], plan.delta)
            if run_after > plan.epsilon * (1 + _SLACK):
                raise PrivacyBudgetError(
                    f"Hospital {self.site} stops training in run {self.run_id}: this run has "
                    f"spent epsilon {run_spent:.4f} (delta {plan.delta:g}) on {data.path} over "
                    f"{len(mine)} trainings, and this training would cost "
                    f"{run_after - run_spent:.4f} more ({run_after:.4f}), above the run's budget "
                    f"of {plan.epsilon:g} ({max(plan.epsilon - run_spent, 0.0):.4f} left; the "
                    f"noise was planned for {plan.rounds} rounds). Start a new run with a new "
                    f"budget (--dp) rather than continuing this one. Received: {where}")
            entry.trainings.append(DPTraining(
                run_id=self.run_id, round=int(server_round), time=_now(),
                noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                steps=plan.steps_per_round, delta=delta, epsilon=after))
        return after

    def record_plain(self, server_round: int) -> None:
        """Count one plain (non-DP) training of the data file (its epsilon is unbounded)."""
        del server_round  # counted, not composed: nothing of the round is needed
        with locked_ledger(self.folder, self.site) as ledger:
            data = describe_file(self.data, ledger.files.get(str(Path(self.data).resolve())))
            _entry(ledger, data).plain_trainings += 1


def ledger_data_path(node: NodeConfig, cfg: RunConfig) -> Path:
    """The data the node config names, as the ledger keys it: the one data file
    (`client.site.resolve_data_path`), else the configured path itself (a recipe reader's
    folder or file)."""
    from fedsplit.client.site import raw_data_path, resolve_data_path

    try:
        return resolve_data_path(node, cfg).resolve()
    except ConfigError:
        return raw_data_path(node, cfg).resolve()


def hospital_account(node: NodeConfig, cfg: RunConfig, site: str,
                     run_id: int | str) -> LedgerAccount:
    """This hospital's ledger account for its data file and run ``run_id`` (its state folder
    and budget from its node config: `client.policy.paths`)."""
    from fedsplit.client.policy.paths import hospital_policy, state_dir

    return LedgerAccount(folder=state_dir(node, cfg, site), site=site,
                         data=ledger_data_path(node, cfg), run_id=str(run_id),
                         budget=hospital_policy(node).dp_budget)


@dataclass(frozen=True)
class FileSpend:
    """One data file's line of the ledger view (`ledger_view`)."""

    path: str
    trainings: int
    runs: int
    plain_trainings: int
    epsilon: float
    delta: float
    budget: float | None

    @property
    def left(self) -> float | None:
        """What is left of the budget (None without one)."""
        return None if self.budget is None else max(self.budget - self.epsilon, 0.0)


def ledger_view(folder: str | Path, budget: DPBudget | None = None) -> list[FileSpend]:
    """Every data file of the ledger in ``folder``: its trainings, runs, epsilon at the budget's
    delta (``budget``, else the one recorded with the file, else its last training's delta) and
    what is left. Refuses a folder without a ledger (`ConfigError`)."""
    folder = Path(folder)
    if not (folder / LEDGER_FILE).is_file():
        raise ConfigError(f"{folder} holds no privacy ledger ({LEDGER_FILE}): give the hospital's "
                          f"state folder (fedsplit site run --state-dir; in fedsplit simulate, "
                          f"OUT/sites/site-N/hospital-state). Received: {folder}")
    ledger = PrivacyLedger.read(folder / LEDGER_FILE)
    out = []
    for key, entry in sorted(ledger.files.items()):
        applied = budget or entry.budget
        delta = (applied.delta if applied is not None
                 else entry.trainings[-1].delta if entry.trainings else 1e-5)
        out.append(FileSpend(key, len(entry.trainings), len(entry.runs()), entry.plain_trainings,
                             compose_epsilon(entry.history(), delta), delta,
                             applied.epsilon if applied is not None else None))
    return out
