"""No module outside `protocol/history.py` reads or builds a run record by its raw JSON keys
(issue 34, item 2): ``history.json``, ``summary.json``, ``privacy.json`` and their parts are read
and written through the models, so a key is spelled in one place.

The check walks every module of the checkout's packages and benches and flags a subscript
(``data["rounds"]``) or ``.get("rounds")`` whose key is a field of a run-record model. Keys that
equally name something else (a Flower run-config key such as ``strategy``, a metric such as
``accuracy``, a wire record such as ``arrays``) are left out of the check: `SHARED_NAMES`. A
model's own code is exempt only in `protocol/history.py` and `protocol/aggregation_report.py`.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import fedsplit.protocol.aggregation_report as aggregation_report
import fedsplit.protocol.history as history
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("aggregation", "bench", "cli", "client", "orchestration", "protocol", "server")
#: the run record's own modules (the aggregation report is a part of it in its own file)
OWNERS = (history, aggregation_report)
OWNER_FILES = {Path("protocol/history.py"), Path("protocol/aggregation_report.py")}

#: Record keys that are also the names of other things fedsplit reads by key: Flower run-config
#: and wire keys, metric names, HDF5 attributes, recipe and schema JSON. A record's reads of
#: these go through the models too, but a grep cannot tell them apart.
SHARED_NAMES = frozenset({
    "accuracy", "arrays", "at", "auc", "baseline", "beta1", "beta2", "columns", "config",
    "dataset", "delta", "details", "digest", "dp", "dtype", "epsilon", "error", "evaluate",
    "examples", "excluded", "features", "flags", "info", "keep", "kind", "km", "labels",
    "level", "lr", "metric", "metrics", "mode", "model", "momentum", "name", "num_examples",
    "params", "reason", "recipe", "round", "schema", "score", "seconds", "selected", "shared",
    "site", "status", "step", "steps", "strategy", "survival", "task", "tau", "train",
    "version", "warnings", "weight", "width",
})

#: (module, key): a dict that is not a run record but uses a record's key name, with why.
NOT_RECORDS = {
    ("protocol/recipe.py", "selection"): "a recipe's JSON body names its selection metric",
    ("bench/flamby_heart.py", "per_site"): "the bench's own row per seed (read from RunSummary)",
    ("bench/flamby_heart.py", "mean_per_site"): "the bench's own row per seed",
    ("bench/flamby_heart.py", "prior_test"): "the bench's own row per seed",
    ("bench/flamby_heart.py", "adopted"): "the bench's own row per seed",
    ("bench/flamby_tcga.py", "per_site"): "the bench's own row per seed (read from RunRecord)",
    ("bench/survival_seeds.py", "federated"): "a column of the bench's own result table",
    ("bench/survival_seeds.py", "centralized"): "a column of the bench's own result table",
}


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


def raw_key_uses(source: str, keys: set[str]) -> list[tuple[int, str]]:
    """(line, key) of every ``x["key"]`` and ``x.get("key", ...)`` in ``source`` with a key in
    ``keys``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args
              and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if isinstance(key, str) and key in keys:
            found.append((node.lineno, key))
    return found


def test_no_module_reads_a_run_record_by_raw_key() -> None:
    keys = record_keys() - SHARED_NAMES
    assert {"rounds", "federated", "local_only", "val_metric", "per_site"} <= keys
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel in OWNER_FILES:
                continue
            for line, key in raw_key_uses(path.read_text(), keys):
                if (rel.as_posix(), key) not in NOT_RECORDS:
                    offenders.append(f"{rel}:{line} [{key!r}]")
    assert not offenders, ("run-record keys read or built by hand (use the models in "
                           "protocol/history.py):\n" + "\n".join(offenders))


def test_the_check_finds_raw_reads() -> None:
    """The scanner flags the shapes a record read takes, and only record keys."""
    code = ('s = json.loads(t)\nx = s["rounds"][0]\ny = s.get("federated", {})\n'
            'z = cfg["num-server-rounds"]\n')
    assert sorted(raw_key_uses(code, record_keys() - SHARED_NAMES)) == [(2, "rounds"),
                                                                        (3, "federated")]
