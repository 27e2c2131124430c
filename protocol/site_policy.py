"""A hospital's own policy file: what its agent runs and what may leave it, whatever a run asks.

The file is the hospital's, kept beside its agent (``fedsplit site run --policy FILE``); the
coordinator never sees or sets it. Its agent applies it to every message it receives
(`fedsplit.client.policy`), refusing what it does not allow with a one-line reason that the
coordinator records against the hospital. Without a file, `SitePolicy()` applies: the defaults
below, chosen so that a federation of fedsplit's own apps runs as before, while rare labels are
withheld, labels are capped and only fedsplit's own code runs.

The file is TOML (or JSON, by its suffix)::

    # /etc/fedsplit/policy.toml
    tasks = ["classification", "regression", "survival"]
    run_kinds = ["horizontal", "vertical", "survival"]
    recipes = ["builtin"]              # built-in models, plus this hospital's own --recipe
    min_category_count = 5             # categories and class labels held by fewer are never named
    min_rows = 5                       # nothing computed on fewer patients leaves (train or held-out)
    rare_labels = "withhold"           # or "refuse": a rare class label stops the run here
    max_labels = 100                   # more distinct class labels in a run: refused
    allow_plain_training = true        # false: every training must be DP-SGD (patient level)
    send = ["weights", "buffers", "statistics", "survival-sums", "embeddings", "secure"]
    trusted_apps = []                  # extra app sha256s this hospital reviewed and runs

    [dp_budget]                        # per data file, across every run (the ledger)
    epsilon = 3.0
    delta = 1e-5

Nothing here is read by raw key outside this module: readers take a `SitePolicy`.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Literal

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.tasks import task_names
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

#: Node-config keys the hospital's agent sets (never the coordinator): its policy file and the
#: folder where it keeps its privacy ledger and egress log.
NODE_POLICY = "policy"
NODE_STATE_DIR = "state-dir"
#: Node-config key naming the coordinator this agent connects to, as the hospital configured it
#: (SuperLink address and the sha256 of the CA certificate it trusts): the egress log's "to whom".
NODE_COORDINATOR = "coordinator"

#: The run kinds a hospital can accept: the horizontal federation (any task), the vertical one,
#: and the survival analyses run after or instead of training (Kaplan-Meier, exact Cox).
#: ``survival`` names the survival app's run kind, spelled as the survival task kind is.
SURVIVAL_RUN = "survival"
RUN_KINDS = ("horizontal", "vertical", SURVIVAL_RUN)
#: Kinds of tensors and numbers that can leave a hospital (`fedsplit.client.policy` classifies
#: every reply into them):
#: - ``weights``: the model's trainable parameters (train replies, the initial model);
#: - ``buffers``: the model's non-trainable tensors (BatchNorm running statistics, counters);
#: - ``statistics``: per-feature sums and sums of squares of the training rows (standardisation);
#: - ``survival-sums``: Kaplan-Meier counts, Breslow and Newton sums of the survival analyses;
#: - ``embeddings``: a vertical branch's embeddings of its patients;
#: - ``secure``: secure aggregation's masked vectors, public keys and shares.
SEND_KINDS = ("weights", "buffers", "statistics", "survival-sums", "embeddings", "secure")
#: The recipe entry that stands for every built-in model (MLP, CNN, the survival Cox recipe).
BUILTIN = "builtin"


class DPBudget(BaseModel):
    """The hospital's privacy budget for one data file, over every run it ever trains."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epsilon: float = Field(gt=0, le=100, description="Total epsilon, all runs together.")
    delta: float = Field(1e-5, gt=0, lt=1, description="The delta every epsilon is read at.")


class SitePolicy(BaseModel):
    """What this hospital accepts (see the module docstring for the file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: default: every registered task kind (`protocol.tasks`)
    tasks: tuple[str, ...] = Field(default_factory=task_names)
    run_kinds: tuple[Literal["horizontal", "vertical", "survival"], ...] = RUN_KINDS
    recipes: tuple[str, ...] = (BUILTIN,)
    min_category_count: int = Field(5, ge=1, le=10_000)
    min_rows: int = Field(5, ge=1, le=1_000_000)
    rare_labels: Literal["withhold", "refuse"] = "withhold"
    max_labels: int = Field(100, ge=2, le=100_000)
    allow_plain_training: bool = True
    dp_budget: DPBudget | None = None
    send: tuple[Literal["weights", "buffers", "statistics", "survival-sums", "embeddings",
                        "secure"], ...] = SEND_KINDS
    trusted_apps: tuple[str, ...] = ()

    @field_validator("recipes")
    @classmethod
    def _recipes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for ref in value:
            if ref != BUILTIN and (":" not in ref or not ref.split(":", 1)[0]):
                raise ValueError(f"a recipe is {BUILTIN!r} or package.module:Attribute "
                                 f"(as --recipe takes it), not {ref!r}")
        return value

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if unknown := [name for name in value if name not in task_names()]:
            raise ValueError(f"a task is a registered task kind ({', '.join(task_names())}), "
                             f"not {', '.join(map(repr, unknown))}")
        return value

    @field_validator("trusted_apps")
    @classmethod
    def _hashes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for digest in value:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"a trusted app is its FAB's sha256, 64 lower-case hex digits "
                                 f"(the agent's log and `fedsplit site trust` print it), not "
                                 f"{digest!r}")
        return value

    def allows_recipe(self, ref: str) -> bool:
        """Whether a run may have this hospital train recipe ``ref`` (``package.module:Attr``);
        the built-in ones are allowed by the entry `BUILTIN`. The hospital's own recipe (its
        agent's ``--recipe``) is always allowed: it is the hospital's choice."""
        return ref in self.recipes

    @classmethod
    def load(cls, path: str | Path | None) -> SitePolicy:
        """The policy in ``path`` (TOML, or JSON by suffix); the defaults when ``path`` is
        empty or None. Any problem is one `ConfigError` naming the file, the field and the fix."""
        if path is None or str(path) == "":
            return cls()
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"The hospital's policy file cannot be read ({e.strerror or e}): "
                              f"give a readable TOML file (docs/privacy.md, \"Hospital policy\"). "
                              f"Received: {path}") from e
        try:
            raw = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"The hospital's policy file {path} is not valid "
                              f"{'JSON' if path.suffix.lower() == '.json' else 'TOML'}: {e}. "
                              f"Received: {path}") from e
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(file)"
            more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
            raise ConfigError(
                f"The hospital's policy file {path}: {where}: {first['msg']}{more}. Fix it "
                f"(fields and defaults: docs/privacy.md, \"Hospital policy\"). Received: "
                f"{where}={first.get('input')!r}") from e


class PolicyRefusal(ConfigError):
    """A hospital's policy refuses what a run asks of it (named in one line, at the hospital)."""

    reason = "hospital_policy"
