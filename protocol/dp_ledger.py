"""The hospital's privacy ledger: the file in which a hospital records every DP-SGD training it
does on each of its data files, across every run, restart and coordinator.

The hospital keeps it (`fedsplit.client.privacy.ledger` writes it, atomically and under a file
lock), in its state folder (`fedsplit.client.policy.paths.state_dir`: ``fedsplit site run
--state-dir DIR``) as `LEDGER_FILE`; it never leaves the hospital. The coordinator's round
numbers are written down as it claimed them (``round``) and never used to count: what a data
file has spent is Opacus's RDP accountant over the file's ``trainings`` (its `history`), read
at a delta.

The file is JSON::

    {"format": "fedsplit.dp-ledger", "version": 1, "site": "north",
     "files": {"/data/north.csv": {
        "path": "/data/north.csv", "size": 48213, "mtime": 1733541123.5, "sha256": "9f2c...",
        "budget": {"epsilon": 3.0, "delta": 1e-05},
        "plain_trainings": 0,
        "trainings": [{"run_id": "8134", "round": 1, "time": "2025-12-07T09:14:03Z",
                       "noise_multiplier": 1.12, "sample_rate": 0.0653, "steps": 10,
                       "delta": 1e-05, "epsilon": 0.31}]}}}

A data file is keyed by its resolved path; its size, modification time and sha256 are
recorded for information (the last seen): a file changed in place keeps its trainings, so a
re-export never resets what its patients have spent. Plain (non-DP) trainings spend an
unbounded epsilon and are only counted (``plain_trainings``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.site_policy import DPBudget
from pydantic import BaseModel, ConfigDict, Field, ValidationError

LEDGER_FORMAT = "fedsplit.dp-ledger"
LEDGER_VERSION = 1
#: The ledger's file name in the hospital's state folder, and the lock file beside it.
LEDGER_FILE = "privacy-ledger.json"
LOCK_FILE = "privacy-ledger.lock"


class DPTraining(BaseModel):
    """One DP-SGD training the hospital did (recorded before it started)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(description="The Flower run that asked for it.")
    round: int = Field(description="The round as the coordinator claimed it (0: none claimed); "
                                   "for information only, never used to count.")
    time: str = Field(description="When the hospital recorded it (ISO 8601, UTC).")
    noise_multiplier: float = Field(ge=0)
    sample_rate: float = Field(gt=0, le=1)
    steps: int = Field(ge=1)
    delta: float = Field(gt=0, lt=1, description="The delta ``epsilon`` is read at.")
    epsilon: float = Field(ge=0, description="The data file's epsilon after this training, over "
                                             "every training recorded for it.")


class DataFileEntry(BaseModel):
    """Everything one data file has been trained for, by this hospital."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="The resolved path of the data file (or folder): the key.")
    size: int = Field(0, ge=0, description="Its size in bytes when last trained (0: a folder).")
    mtime: float = Field(0.0, description="Its modification time when last trained.")
    sha256: str = Field("", description="Its sha256 when last trained ('': a folder).")
    budget: DPBudget | None = Field(None, description="The hospital's budget for it, as last "
                                                      "applied (its policy's dp_budget).")
    plain_trainings: int = Field(0, ge=0, description="Trainings without DP (unbounded epsilon).")
    trainings: list[DPTraining] = Field(default_factory=list)

    def history(self, run_id: str | None = None) -> list[tuple[float, float, int]]:
        """(noise multiplier, sample rate, steps) of every recorded DP-SGD training (of run
        ``run_id`` only, when given): an Opacus ``RDPAccountant.history``."""
        return [(t.noise_multiplier, t.sample_rate, t.steps) for t in self.trainings
                if run_id is None or t.run_id == run_id]

    def runs(self) -> list[str]:
        """The runs that trained this file with DP-SGD, in the order they first did."""
        return list(dict.fromkeys(t.run_id for t in self.trainings))


class PrivacyLedger(BaseModel):
    """The whole ledger file of one hospital (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["fedsplit.dp-ledger"] = LEDGER_FORMAT
    version: Literal[1] = LEDGER_VERSION
    site: str = ""
    files: dict[str, DataFileEntry] = Field(default_factory=dict)

    def to_json(self) -> str:
        """The file's text (indented JSON)."""
        return self.model_dump_json(indent=2)

    @classmethod
    def read(cls, path: str | Path) -> PrivacyLedger:
        """The ledger in ``path``; an empty one when the file does not exist. A file that cannot
        be read or is not a ledger is refused (`ConfigError`), never taken as empty: an empty
        ledger would give the hospital's patients their whole budget again."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls()
        except OSError as e:
            raise ConfigError(f"The hospital's privacy ledger cannot be read ({e.strerror or e}); "
                              f"no DP training runs until it can: fix its permissions or restore "
                              f"it from a backup (docs/privacy.md, \"The hospital's privacy "
                              f"ledger\"). Received: {path}") from e
        try:
            return cls.model_validate(json.loads(text))
        except (json.JSONDecodeError, ValidationError) as e:
            detail = (f"{'.'.join(str(p) for p in e.errors()[0]['loc'])}: {e.errors()[0]['msg']}"
                      if isinstance(e, ValidationError) else str(e))
            raise ConfigError(f"The hospital's privacy ledger {path} is damaged ({detail}); no DP "
                              f"training runs until it is restored from a backup (deleting it "
                              f"would give every patient the whole budget again). Received: "
                              f"{text[:80]!r}") from e
