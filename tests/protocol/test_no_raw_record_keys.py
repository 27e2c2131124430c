"""No module outside the run record's own (`protocol/record/`, `protocol/aggregation_report.py`)
reads or builds a run-record document by its raw JSON keys (issue 34, item 2; issue 42, item 3):
``history.json``, ``summary.json``, ``privacy.json``, ``fills.json``, ``km.json``, ``cox.json``
and their parts are written and read only through their models, so a key is spelled in one place.

The check walks every module of the checkout's packages and benches and flags every shape a raw
record access takes, with any field name (or alias) of any record model as the key:
``x["key"]``, ``x.get("key")``, ``x.pop("key")``, ``x.setdefault("key")``, ``"key" in x``,
``{"key": ...}`` and ``dict(key=...)``. There is no list of "common" keys: a key that is also
another format's (a Flower record name, a run-config key, the table schema's JSON, a metric
name) is allowed only in the file that reads that format (`ALLOWED`: the file, why, and exactly
which keys), so a record key used in any other file, or a new record key in an allowed file,
fails the check.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import NamedTuple

import fedsplit.protocol.aggregation_report as aggregation_report
import fedsplit.protocol.record as record
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("aggregation", "bench", "cli", "client", "orchestration", "protocol", "server")
#: the run record's own modules (the aggregation report is a part of it in its own file)
OWNERS = (aggregation_report, *(importlib.import_module(f"{record.__name__}.{m.name}")
                                for m in pkgutil.iter_modules(record.__path__)))


class Allowance(NamedTuple):
    """Record-named keys one file may use because they are another format's, and which."""

    reason: str
    keys: set[str]


#: file -> the format whose keys it reads or builds, and exactly those keys.
ALLOWED: dict[str, Allowance] = {
    "aggregation/geometric_median.py": Allowance(
        "the rule's free-form report details (AggregationReport.details)",
        {"steps"}),
    "bench/aggregation.py": Allowance(
        "the bench's own result JSON",
        {"details", "memory_budget", "params", "working_bytes"}),
    "bench/bare_flower_app.py": Allowance(
        "a bare Flower app's own status file and Flower records",
        {"arrays", "config", "metrics", "round", "rounds", "seconds", "status"}),
    "bench/deploy_bare/bare_app/client_app.py": Allowance(
        "a bare Flower app's records and metric names",
        {"accuracy", "arrays", "metrics"}),
    "bench/deploy_bare/bare_app/server_app.py": Allowance(
        "a bare Flower app's run config",
        {"evaluate"}),
    "bench/deploy_rounds.py": Allowance(
        "the bench's own timing notes",
        {"round"}),
    "bench/scale_deploy.py": Allowance(
        "the bench's result JSON",
        {"hospitals", "rounds"}),
    "bench/flamby_heart.py": Allowance(
        "the bench's own rows per seed (runs read through RunSummary); metric names",
        {"accuracy", "adopted", "config", "mean_per_site", "per_site", "prior_test", "runs",
         "seconds", "server_opt"}),
    "bench/flamby_tcga.py": Allowance(
        "RunConfig keyword names and the bench's own rows per seed",
        {"penalizer", "per_site", "recipe", "seconds"}),
    "bench/hospital_policy_overhead.py": Allowance(
        "Flower records of a hand-built message",
        {"arrays", "config"}),
    "bench/psi_bench.py": Allowance(
        "the bench's own result rows",
        {"shared"}),
    "bench/round_overhead.py": Allowance(
        "the bench's own result JSON",
        {"dataset", "model_id", "rounds", "sites"}),
    "bench/scale.py": Allowance(
        "the bare Flower app's own status file and the bench's own result JSON",
        {"model_id", "rounds", "rows", "seconds", "status"}),
    "server/reply_pull.py": Allowance(
        "the header Flower 1.42 writes for each Array it sends (its dtype, shape, stype)",
        {"dtype"}),
    "bench/secure_aggregation_flower.py": Allowance(
        "secure aggregation's free-form report details; the bench's rows",
        {"accuracy", "hospitals", "secure_aggregation"}),
    "bench/survival_seeds.py": Allowance(
        "RunConfig keyword names and the bench's own rows per seed",
        {"centralized", "dataset", "federated", "lr", "rounds", "seconds", "server_opt",
         "test_rows", "train_rows"}),
    "bench/vertical_seeds.py": Allowance(
        "the bench's own rows per seed",
        {"centralized", "metric", "rounds_kept"}),
    "cli/admin_audit_show.py": Allowance(
        "an admin audit-log entry as JSON (server.admin.audit)",
        {"at"}),
    "cli/options.py": Allowance(
        "RunConfig keyword names built from the command's options",
        {"keep", "min_count", "recipe", "secure_aggregation", "strategy_params"}),
    "cli/pipeline_schedule.py": Allowance(
        "pipeline phase names (fill, steady, drain)",
        {"fill"}),
    "cli/simulate.py": Allowance(
        "RunConfig keyword names built from the command's options",
        {"attack", "dp"}),
    "cli/site_egress.py": Allowance(
        "the egress log's count names",
        {"rows"}),
    "cli/up.py": Allowance(
        "metric names of a recipe",
        {"accuracy"}),
    "cli/upload.py": Allowance(
        "the admin server's upload receipt (HTTP JSON)",
        {"num_examples"}),
    "cli/vertical.py": Allowance(
        "FusionParams keyword names",
        {"fill", "lr", "steps_per_round"}),
    "client/app.py": Allowance(
        "the train reply's site record (protocol.horizontal_wire)",
        {"name"}),
    "client/data.py": Allowance(
        "a bundled dataset's column",
        {"dataset"}),
    "client/optim.py": Allowance(
        "torch optimizer state keys",
        {"step"}),
    "client/parallel/api.py": Allowance(
        "in-site parallel training's job settings",
        {"lr"}),
    "client/parallel/config.py": Allowance(
        "the hospital's parallel-training settings (JSON)",
        {"mode", "model"}),
    "client/parallel/launch.py": Allowance(
        "in-site parallel workers' results",
        {"seconds"}),
    "client/parallel/pipeline.py": Allowance(
        "in-site parallel workers' results",
        {"seconds"}),
    "client/parallel/replicas.py": Allowance(
        "in-site parallel workers' results",
        {"seconds"}),
    "client/policy/contents.py": Allowance(
        "Flower record contents the hospital's policy inspects",
        {"dtype", "name", "rows", "task"}),
    "client/policy/egress.py": Allowance(
        "the egress log's entries (protocol.egress_log)",
        {"at"}),
    "client/policy/enforce.py": Allowance(
        "the hospital's policy decisions and the records they inspect",
        {"dp", "epsilon", "labels", "metrics", "reason", "recipe", "round", "run", "site",
         "task"}),
    "client/secure/agent.py": Allowance(
        "Flower records of secure aggregation",
        {"metrics", "site"}),
    "client/secure/secagg.py": Allowance(
        "SecAgg+ stage state (Flower's protocol)",
        {"round"}),
    "client/site.py": Allowance(
        "a recipe's settings (JSON)",
        {"penalizer"}),
    "client/survival/app.py": Allowance(
        "Flower records of the survival instructions",
        {"at_risk", "events", "name", "schema", "survival", "time"}),
    "client/survival/recipe.py": Allowance(
        "a survival recipe's metric names",
        {"auc"}),
    "client/survival/summary.py": Allowance(
        "Flower records of the survival summary",
        {"name", "rows", "schema"}),
    "client/vertical/model.py": Allowance(
        "torch optimizer state keys",
        {"step"}),
    "client/vertical/site.py": Allowance(
        "Flower records of vertical messages",
        {"lr", "rows", "shared", "site"}),
    "orchestration/app_launcher.py": Allowance(
        "a Flower app's pyproject metadata",
        {"name", "version"}),
    "orchestration/app_trust.py": Allowance(
        "the trusted Flower apps by task name",
        {"survival"}),
    "orchestration/datasets.py": Allowance(
        "RunConfig keyword names of a bundled dataset",
        {"penalizer", "task"}),
    "orchestration/experiment.py": Allowance(
        "the run settings' keyword names",
        {"site_names", "task"}),
    "orchestration/fingerprint.py": Allowance(
        "a data fingerprint's JSON (rows, columns per site)",
        {"columns", "rows"}),
    "orchestration/local_federation.py": Allowance(
        "a local process's event record",
        {"at"}),
    "orchestration/plots.py": Allowance(
        "pipeline phase names (plot colours)",
        {"fill"}),
    "orchestration/privacy_audit.py": Allowance(
        "metric names of a recipe",
        {"accuracy"}),
    "orchestration/survival/run.py": Allowance(
        "SurvivalRun's field names",
        {"site_names"}),
    "orchestration/up.py": Allowance(
        "a data fingerprint's JSON (rows, columns per site)",
        {"columns", "rows"}),
    "orchestration/vertical/experiment.py": Allowance(
        "FusionParams' field names",
        {"fill"}),
    "orchestration/vertical/local.py": Allowance(
        "FusionParams' field names",
        {"fill"}),
    "orchestration/vertical/predict.py": Allowance(
        "metric names of a recipe",
        {"accuracy"}),
    "protocol/arrays.py": Allowance(
        "an array spec's JSON (name, dtype)",
        {"dtype", "name"}),
    "protocol/config.py": Allowance(
        "Flower run-config keys, a task kind's recipe settings and the run settings' names",
        {"penalizer", "site_names", "task"}),
    "protocol/horizontal_wire.py": Allowance(
        "Flower record names and wire keys of horizontal training",
        {"arrays", "config", "features", "kind", "metrics", "name", "recipe", "task"}),
    "protocol/keras_layout.py": Allowance(
        "Keras model.json layout keys",
        {"dtype", "kind", "name"}),
    "protocol/privacy.py": Allowance(
        "a DP spec's fields",
        {"level"}),
    "protocol/recipe.py": Allowance(
        "a recipe's identity JSON",
        {"name", "params", "selection", "task", "version"}),
    "protocol/schema.py": Allowance(
        "the table schema's and column report's own JSON",
        {"columns", "kind", "labels", "name", "rows", "site", "task", "version"}),
    "protocol/survival.py": Allowance(
        "survival instruction stage names",
        {"concordance"}),
    "protocol/survival_summary.py": Allowance(
        "survival summary stages and global.baseline.json (Baseline)",
        {"baseline", "concordance", "events", "hospitals", "min_count", "model", "model_id",
         "rows", "secure_aggregation", "shared", "time"}),
    "protocol/tasks.py": Allowance(
        "a task kind's metric and client-phase names",
        {"accuracy", "survival"}),
    "protocol/vertical/wire.py": Allowance(
        "Flower record names of vertical messages",
        {"arrays", "config"}),
    "protocol/weights.py": Allowance(
        "HDF5 attributes of a weights file",
        {"model", "num_examples", "round", "schema", "site"}),
    "server/admin/app.py": Allowance(
        "the admin API's error JSON",
        {"error", "reason"}),
    "server/admin/audit.py": Allowance(
        "an admin audit-log entry as JSON",
        {"at"}),
    "server/admin/inspection.py": Allowance(
        "a refusal's JSON (admin API)",
        {"reason"}),
    "server/admin/keras_layouts.py": Allowance(
        "Keras model.json layout keys",
        {"kind", "name"}),
    "server/admin/limits.py": Allowance(
        "ASGI messages and the admin API's error JSON",
        {"error", "reason", "status"}),
    "server/admin/routes/health.py": Allowance(
        "the admin API's JSON (health, rounds)",
        {"model", "schema", "status"}),
    "server/admin/routes/rounds.py": Allowance(
        "FastAPI's response declarations",
        {"model", "num_examples", "schema"}),
    "server/admin/services/downloads.py": Allowance(
        "a Keras layout's kind",
        {"kind"}),
    "server/admin/services/isolation.py": Allowance(
        "a hospital's view of a REST round (the report keys it may see); words of an error",
        {"late", "sites"}),
    "server/admin/services/rounds.py": Allowance(
        "a Keras layout's kind",
        {"kind"}),
    "server/admin/store.py": Allowance(
        "SQL column descriptions",
        {"name"}),
    "server/admin/ui/curves.py": Allowance(
        "Flower run-config keys",
        {"dp"}),
    "server/admin/ui/pages.py": Allowance(
        "the web view's template context",
        {"status"}),
    "server/admin/ui/routes.py": Allowance(
        "the web view's template context",
        {"error", "events", "metric", "privacy", "round", "rounds", "run", "runs"}),
    "server/admin/ui/runs.py": Allowance(
        "Flower run-config keys and analysis names",
        {"km", "strategy"}),
    "server/history.py": Allowance(
        "Flower run-config keys and a data fingerprint's JSON",
        {"keep", "rounds", "rows"}),
    "server/secure/merge.py": Allowance(
        "Flower records of secure aggregation and its report details",
        {"hospitals", "metrics", "secure", "secure_aggregation", "site"}),
    "server/secure/secagg.py": Allowance(
        "SecAgg+ stage instructions (Flower's protocol)",
        {"round"}),
    "server/survival/app.py": Allowance(
        "survival instruction keys",
        {"name", "schema"}),
    "server/survival/exact.py": Allowance(
        "survival instruction keys, the Newton rule's report details and metrics",
        {"concordance", "log_likelihood", "penalizer", "schema"}),
    "server/survival/summary.py": Allowance(
        "survival summary instruction keys",
        {"baseline", "rows", "schema"}),
    "server/vertical/coordinator.py": Allowance(
        "Flower records of vertical messages and metric names",
        {"lr", "rows", "shared", "site"}),
}


def owner_file(rel: Path) -> bool:
    """Whether ``rel`` is one of the record's own modules."""
    return rel.parts[:2] == ("protocol", "record") or rel == Path("protocol/aggregation_report.py")


def record_keys() -> set[str]:
    """Every field name and alias of the run-record models (`OWNERS`)."""
    keys: set[str] = set()
    for module in OWNERS:
        for obj in vars(module).values():
            if not (inspect.isclass(obj) and issubclass(obj, BaseModel)
                    and obj.__module__ == module.__name__):
                continue
            for name, field in obj.model_fields.items():
                keys.add(name)
                if field.alias:
                    keys.add(field.alias)
    return keys


def _constant(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def keys_used(node: ast.AST) -> list[object]:
    """The constant keys ``node`` reads or builds a mapping with (empty: not such a node)."""
    if isinstance(node, ast.Subscript):
        return [_constant(node.slice)]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault") and node.args):
        return [_constant(node.args[0])]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return [k.arg for k in node.keywords if k.arg is not None]
    if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn)
                                             for op in node.ops):
        return [_constant(node.left)]
    if isinstance(node, ast.Dict):
        return [_constant(k) for k in node.keys]
    return []


def raw_key_uses(source: str, keys: set[str]) -> list[tuple[int, str]]:
    """(line, key) of every raw access of ``source`` (module docstring) with a key in ``keys``."""
    return [(node.lineno, key) for node in ast.walk(ast.parse(source))
            for key in keys_used(node) if isinstance(key, str) and key in keys]


@functools.cache
def findings() -> dict[str, list[tuple[int, str]]]:
    """Every module's raw record-key uses, by path (the record's own modules left out)."""
    keys = record_keys()
    found: dict[str, list[tuple[int, str]]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if not owner_file(rel) and (uses := raw_key_uses(path.read_text(), keys)):
                found[rel.as_posix()] = uses
    return found


def test_no_module_reads_or_builds_a_record_by_raw_key() -> None:
    offenders = [f"{path}:{line} [{key!r}]" for path, uses in findings().items()
                 for line, key in uses
                 if key not in (ALLOWED[path].keys if path in ALLOWED else set())]
    assert not offenders, ("run-record keys read or built by hand (read and write through the "
                           "models in protocol/record/; a key that is another format's goes in "
                           "ALLOWED with its file and why):\n" + "\n".join(offenders))


def test_every_allowance_is_still_needed() -> None:
    """An allowance that no longer matches a use is removed, so the list cannot grow stale."""
    found = {path: {key for _, key in uses} for path, uses in findings().items()}
    stale = [f"{path}: {sorted(allowed.keys - found.get(path, set()))}"
             for path, allowed in ALLOWED.items() if allowed.keys - found.get(path, set())]
    assert not stale, "allowances no longer used (remove them):\n" + "\n".join(stale)


def test_the_check_finds_every_shape_of_raw_access() -> None:
    """The scanner flags each shape a record access takes, and only record keys; the shape of
    `orchestration.experiment.kept_round` before issue 42 (a dict literal of FederatedScores'
    keys) is among them."""
    code = ('s = json.loads(t)\nx = s["rounds"][0]\ny = s.get("federated", {})\n'
            'z = cfg["num-server-rounds"]\nw = s.pop("local_only")\nif "val_metric" in s: pass\n'
            'k = {"keep": 1, "rounds_kept": 2, "other-key": 3}\nd = dict(val_rounds=[1])\n'
            'e = s.setdefault("per_site", {})\n')
    assert sorted(raw_key_uses(code, record_keys())) == [
        (2, "rounds"), (3, "federated"), (5, "local_only"), (6, "val_metric"), (7, "keep"),
        (7, "rounds_kept"), (8, "val_rounds"), (9, "per_site")]


def test_the_km_and_cox_documents_are_record_models() -> None:
    """km.json and cox.json keys are record keys too: their readers cannot go around them."""
    assert {"curve", "at_risk", "min_count", "covariates", "hazard_ratio", "newton_steps"} <= (
        record_keys())
