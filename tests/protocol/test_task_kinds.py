"""Task kinds are compared nowhere but in their registry (issue 42, item 2).

Code asks a kind what it declares (`protocol.tasks.task_kind(name).classes`, ``.selection``,
``.server_phases``, ...) instead of testing which kind it is, so a new kind is one `register`
call (tests/protocol/toy_task.py). The check walks every module of the checkout's packages and
benches except `protocol/tasks.py` and flags:

- a comparison (``==``, ``!=``, ``in``, ``not in``, ``is``) or ``match`` case with a string equal
  to a registered kind's name (``task == "classification"``, ``task in ("regression", ...)``);
- a comparison with the registry's kind constants (``CLASSIFICATION``, ``REGRESSION``,
  ``SURVIVAL``, by name or attribute), or with a module-level name bound to such a string or to
  a tuple, list or set of them (``TASKS = ("classification", ...)``; ``task in TASKS``);
- a dict literal keyed by two kinds' names or more (a dispatch table on the name; one such key
  is data, e.g. a Kaplan-Meier curve's ``survival`` column).

One word is shared: ``survival`` is also a run kind (the ``fedsplit km``/``cox`` app,
`protocol.site_policy.SURVIVAL_RUN`), compared as a run kind, never as a task.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fedsplit.protocol import tasks
from fedsplit.protocol.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("aggregation", "bench", "cli", "client", "orchestration", "protocol", "server")
REGISTRY = Path("protocol/tasks.py")
KIND_NAMES = frozenset(tasks.BUILTIN)
CONSTANTS = frozenset(name.upper() for name in KIND_NAMES)
#: the run kinds' own names, spelled as a task kind is (module docstring)
RUN_KIND_NAMES = frozenset({"SURVIVAL_RUN"})
COMPARE = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _kind_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in KIND_NAMES


def _kind_literals(node: ast.AST) -> bool:
    """A kind's name, or a tuple, list or set holding one."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_kind_literal(e) for e in node.elts)
    return _kind_literal(node)


def _bound(tree: ast.Module) -> set[str]:
    """Module-level names bound to a kind's name or a collection of them."""
    names: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _kind_literals(value):
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names - RUN_KIND_NAMES


def _names_kind(node: ast.AST, bound: set[str]) -> bool:
    if _kind_literals(node):
        return True
    if isinstance(node, ast.Name):
        return node.id in CONSTANTS | bound
    if isinstance(node, ast.Attribute):
        return node.attr in CONSTANTS
    return False


def violations(source: str, where: str = "<source>") -> list[str]:
    """Every place in ``source`` that compares a task kind by its name (module docstring)."""
    tree = ast.parse(source)
    bound = _bound(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, COMPARE) for op in node.ops):
            if any(_names_kind(side, bound) for side in [node.left, *node.comparators]):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.MatchValue) and _kind_literal(node.value):
            found.append(f"{where}:{node.lineno}: case {ast.unparse(node.value)}")
        elif isinstance(node, ast.Dict) and len({k.value for k in node.keys
                                                 if k is not None and _kind_literal(k)}) > 1:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_task_kind_is_compared_outside_the_registry() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel != REGISTRY:
                found += violations(path.read_text(), str(rel))
    assert not found, ("Task kinds compared by name (ask protocol.tasks.task_kind(name) what "
                       "the kind declares instead):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    'if task == "classification": pass',
    'x = "accuracy" if summary.task != "regression" else "r2"',
    'ok = task in ("regression", "survival")',
    'ok = task not in ["classification"]',
    "from fedsplit.protocol.tasks import SURVIVAL\nok = cfg.task == SURVIVAL",
    "from fedsplit.protocol import tasks\nok = kind is tasks.CLASSIFICATION",
    'TASKS = ("classification", "regression")\nok = name in TASKS',
    'NAME: str = "survival"\nok = task == NAME',
    'match task:\n    case "survival":\n        pass',
    'METRIC = {"classification": "accuracy", "regression": "r2"}',
])
def test_the_check_finds_each_form(source: str) -> None:
    assert violations(source)


@pytest.mark.parametrize("source", [
    "ok = task_kind(task).classes",
    'ok = task == "auto"',
    'SURVIVAL_RUN = "survival"\nok = app == SURVIVAL_RUN',
    'value = curve["survival"]',
    'label = "survival"',
])
def test_the_check_leaves_other_code(source: str) -> None:
    assert not violations(source)


def test_the_built_in_kinds_declare_what_was_compared_by_name() -> None:
    assert tasks.task_names()[:3] == ("classification", "regression", "survival")
    assert [tasks.task_kind(n).selection for n in ("classification", "regression", "survival")] \
        == ["accuracy", "r2", "c_index"]
    assert tasks.CLASSIFICATION.classes and tasks.REGRESSION.values and tasks.SURVIVAL.time_event
    assert tasks.REGRESSION.score([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == {"r2": 1.0, "rmse": 0.0}
    assert tasks.CLASSIFICATION.score([0, 1, 1, 0], [0, 1, 0, 0]) == {"accuracy": 0.75}
    assert tasks.infer_task([0, 1, 1, 2]) == "classification"
    assert tasks.infer_task([0.5, 1.25, 3.0]) == "regression"
    assert tasks.infer_task(["yes", "no"]) == "classification"
    assert tasks.declared("auto") is None and tasks.label_encoding("auto") is None
    assert tasks.recipe_kind(tasks.SURVIVAL.recipe) is tasks.SURVIVAL
    assert tasks.resolve(tasks.SURVIVAL.recipe).__name__ == "Cox"


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "auto"}, "not 'auto'"),
    ({"selection": "f1"}, "selection metric must be one of its metrics"),
    ({"scores": {"f1": tasks.accuracy}}, "scores metrics it does not declare"),
    ({"baselines": ("pooled",)}, "baselines are some of"),
    ({"server_phases": {"before": "m:f"}}, "server phases are"),
])
def test_a_kind_that_contradicts_itself_is_refused(fields: dict, message: str) -> None:
    declared = {"name": "toy", "labels": tasks.LabelEncoding.VALUES, "metrics": ("r2",),
                "selection": "r2", **fields}
    with pytest.raises(ConfigError, match=message):
        tasks.TaskKind(**declared)


def test_a_built_in_kind_is_never_replaced_and_an_unknown_one_is_named() -> None:
    with pytest.raises(ConfigError, match="is built in"):
        tasks.register(tasks.TaskKind(name="regression", labels=tasks.LabelEncoding.VALUES,
                                      metrics=("rmse",), selection="rmse"))
    with pytest.raises(ConfigError, match="No task kind is named 'segmentation'"):
        tasks.task_kind("segmentation")
    with pytest.raises(ConfigError, match="'module:attribute'"):
        tasks.resolve("no-colon")
