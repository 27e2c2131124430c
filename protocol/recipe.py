"""A recipe's identity: what the hospitals and the coordinator compare, and what the model id says.

A recipe (`client.recipes.Recipe`) is the code that builds a hospital's model, its loss, its
metrics and optionally its data reader and training step. Its code is installed by each party's
operator, never sent; what travels is its identity: a name, a version and its validated
parameters (`RecipeIdentity`). Before round 1 every hospital reports the identity of the recipe
it runs and the coordinator refuses a federation whose hospitals differ (`check_same_recipe`,
naming the hospital and the difference); each hospital again checks the identity inside every
model id it is sent against its own.

Model ids (weight-file attribute ``model``, Flower config ``model-id``):

- the built-in MLP and CNN keep their short form ``kind/task/shape/outputs/hidden[/norm]``
  (e.g. ``mlp/classification/30/2/64-32``), which older weight files carry;
- every other recipe's model is ``recipe:`` followed by canonical JSON with the recipe's
  ``name``, ``version``, ``params``, and the model's ``task``, ``input_shape``, ``num_outputs``
  and ``selection`` (the metric, higher is better, by which the coordinator keeps a round)
  (`RecipeModelId`). So a weight file records the recipe it was trained with, and anyone with
  that recipe installed rebuilds the model from the file alone.

**One identity for every model** (`model_identity`): any model id, short or ``recipe:``, reads
as the same `ModelIdentity` (the recipe's identity, the task, the input shape, the outputs and
the selection metric), so callers ask it what they need (`model_selection`, `describe_model`)
instead of telling built-ins from recipes themselves. Which recipes keep the short form is
decided here too (`BUILTIN_RECIPES`, `builtin_identity`, `request_kind`).

A recipe is referenced by its users as ``module:attribute`` or by the name of an entry point in
the ``fedsplit.recipes`` group (`parse_reference`); this module only parses the reference, it
imports nothing (the coordinator never runs recipe code).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.tasks import task_kind
from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Entry-point group under which an installed package registers its recipes.
ENTRY_POINT_GROUP = "fedsplit.recipes"
#: Prefix of a model id built by a recipe other than the built-in MLP and CNN.
RECIPE_ID_PREFIX = "recipe:"
#: The built-in recipes: their models keep the short ids (``mlp/...``, ``cnn/...``).
BUILTIN_RECIPES = ("mlp", "cnn")
#: The built-in recipes' version.
BUILTIN_VERSION = "1"
#: ``query.init``'s model kind for any other recipe: the hospitals build it with their own.
RECIPE_KIND = "recipe"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MODULE_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class RecipeIdentity(BaseModel):
    """Name, version and validated parameters of a recipe: equal identities train one model.

    Parameters
    ----------
    name : str
        The recipe's name (1-64 letters, digits, ``_.-``), e.g. ``mlp`` or ``digits-cnn``.
    version : str
        The recipe's own version string; hospitals on different versions are refused.
    params : dict
        The recipe's parameters after validation (defaults filled in), JSON values only.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME.pattern)
    version: str = Field(min_length=1, max_length=64)
    params: dict[str, Any] = Field(default_factory=dict)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal identities give equal text."""
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, *, where: str = "recipe identity") -> RecipeIdentity:
        """Parse `to_json` output; bad text raises `ConfigError` naming ``where``."""
        try:
            return cls.model_validate(json.loads(text))
        except (ValueError, ValidationError) as e:
            raise ConfigError(f"{where} is not a recipe identity (JSON with name, version, params). "
                              f"({e}) Received: {text[:200]!r}") from e

    def label(self) -> str:
        """``name`` version ``version`` for messages."""
        return f"{self.name} version {self.version}"

    def differences(self, other: RecipeIdentity) -> list[str]:
        """What differs from ``other``, one phrase per field (``[]`` when equal)."""
        out = []
        if self.name != other.name:
            out.append(f"name {self.name!r} vs {other.name!r}")
        if self.version != other.version:
            out.append(f"version {self.version!r} vs {other.version!r}")
        keys = sorted(set(self.params) | set(other.params))
        for key in keys:
            mine, theirs = self.params.get(key, "<unset>"), other.params.get(key, "<unset>")
            if _canonical(mine) != _canonical(theirs):
                out.append(f"param {key}={mine!r} vs {theirs!r}")
        return out


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def check_same_recipe(sites: Mapping[str, RecipeIdentity]) -> RecipeIdentity:
    """The one recipe every hospital runs; a hospital that differs raises `ConfigError` naming
    it and the difference, compared with the recipe most hospitals run (on a tie, the first
    hospital's), so the odd hospital is named whatever order the replies arrived in."""
    if not sites:
        raise ConfigError("No hospital reported its recipe. Received: 0 hospitals")
    names = list(sites)
    keys = [sites[n].to_json() for n in names]
    ref_name = names[max(range(len(names)), key=lambda i: (keys.count(keys[i]), -i))]
    ref = sites[ref_name]
    problems = [f"hospital {name} runs {other.label()} ({'; '.join(other.differences(ref))})"
                for name, other in sites.items() if other.differences(ref)]
    if problems:
        raise ConfigError(
            f"Every hospital must run the same recipe (name, version and parameters) before round "
            f"1; hospital {ref_name} runs {ref.label()} with params {ref.params}, but "
            f"{', and '.join(problems)}. Install the same recipe version at every hospital and "
            f"give them the same --recipe-params. Received: "
            f"{ {n: s.to_json() for n, s in sites.items()} }"
        )
    return ref


@dataclass(frozen=True)
class RecipeModelId:
    """The model id of a recipe model: the recipe's identity and what its inputs look like."""

    recipe: RecipeIdentity
    task: str
    input_shape: tuple[int, ...]
    num_outputs: int
    selection: str = "accuracy"

    def to_id(self) -> str:
        """``recipe:`` + canonical JSON."""
        body = {"name": self.recipe.name, "version": self.recipe.version,
                "params": self.recipe.params, "task": self.task,
                "input_shape": list(self.input_shape), "num_outputs": self.num_outputs,
                "selection": self.selection}
        return RECIPE_ID_PREFIX + json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_id(cls, model_id: str) -> RecipeModelId:
        """Parse a ``recipe:`` model id; anything else raises `ConfigError`."""
        if not is_recipe_id(model_id):
            raise ConfigError(f"Not a recipe model id (it starts with {RECIPE_ID_PREFIX!r}). "
                              f"Received: {model_id[:120]!r}")
        try:
            body = json.loads(model_id[len(RECIPE_ID_PREFIX):])
            identity = RecipeIdentity(name=body["name"], version=body["version"],
                                      params=body["params"])
            shape = tuple(int(d) for d in body["input_shape"])
            outputs = int(body["num_outputs"])
            task = str(body["task"])
            selection = str(body.get("selection") or "accuracy")
        except (ValueError, KeyError, TypeError, ValidationError) as e:
            raise ConfigError(
                f"A recipe model id is 'recipe:' + JSON with name, version, params, task, "
                f"input_shape and num_outputs. ({e}) Received: {model_id[:200]!r}"
            ) from e
        if not task or outputs < 1 or not shape or min(shape) < 1:
            raise ConfigError(f"A recipe model id needs a task, positive input dimensions and at "
                              f"least one output. Received: {model_id[:200]!r}")
        return cls(identity, task, shape, outputs, selection)


def is_recipe_id(model_id: str) -> bool:
    """Whether ``model_id`` names a recipe model (not the built-in short form)."""
    return model_id.startswith(RECIPE_ID_PREFIX)


def builtin_identity(kind: str, hidden: tuple[int, ...] | list[int] = (),
                     norm: str = "none") -> RecipeIdentity:
    """The identity of a built-in recipe (``mlp`` with its hidden widths and norm, or ``cnn``)."""
    params = {"hidden": [int(h) for h in hidden], "norm": norm} if kind == "mlp" else {}
    return RecipeIdentity(name=kind, version=BUILTIN_VERSION, params=params)


def keeps_short_id(recipe: RecipeIdentity) -> bool:
    """Whether ``recipe``'s models keep the short id form (the built-in MLP and CNN)."""
    return recipe.name in BUILTIN_RECIPES


def request_kind(recipe: RecipeIdentity | None, builtin_kind: str) -> str:
    """The model kind ``query.init`` asks for: ``builtin_kind`` (``mlp``/``cnn``, by the run
    config or the data) when the hospitals run a built-in recipe (or report none), else
    `RECIPE_KIND` (each hospital builds it with its own recipe)."""
    return builtin_kind if recipe is None or keeps_short_id(recipe) else RECIPE_KIND


def requested_recipe(kind: str, hidden: tuple[int, ...] | list[int] = (),
                     norm: str = "none") -> RecipeIdentity | None:
    """The recipe a ``query.init`` request names: a built-in's identity, or None for
    `RECIPE_KIND` (the hospital's own recipe)."""
    return builtin_identity(kind, hidden, norm) if kind in BUILTIN_RECIPES else None


@dataclass(frozen=True)
class ModelIdentity:
    """What any model id says, whichever recipe built the model.

    Attributes
    ----------
    recipe : RecipeIdentity
        The recipe that builds it (``mlp``/``cnn`` version 1 for a short id).
    task, input_shape, num_outputs
        The model's task, one row's shape and its outputs.
    selection : str
        The metric (higher is better) its rounds are kept by: the recipe's own, or for a short
        id ``accuracy`` (classification) / ``r2`` (regression).
    """

    recipe: RecipeIdentity
    task: str
    input_shape: tuple[int, ...]
    num_outputs: int
    selection: str

    @property
    def short_id(self) -> bool:
        """Whether the model's id has the short form (`keeps_short_id`)."""
        return keeps_short_id(self.recipe)


def model_identity(model_id: str) -> ModelIdentity:
    """Read any model id: ``recipe:{...}`` (`RecipeModelId`) or the built-ins' short form
    ``kind/task/shape/outputs/hidden[/norm]``; anything else raises `ConfigError`."""
    if is_recipe_id(model_id):
        ref = RecipeModelId.from_id(model_id)
        return ModelIdentity(ref.recipe, ref.task, ref.input_shape, ref.num_outputs, ref.selection)
    parts = str(model_id).split("/")
    try:
        if len(parts) not in (5, 6) or parts[0] not in BUILTIN_RECIPES:
            raise ValueError(f"{len(parts)} parts, kind {parts[0]!r}")
        kind, task, shape, outputs, hidden = parts[:5]
        norm = parts[5] if len(parts) == 6 else "none"
        widths = tuple(int(h) for h in hidden.split("-")) if hidden != "-" else ()
        dims = tuple(int(d) for d in shape.split("x"))
        count = int(outputs)
    except ValueError as e:
        raise ConfigError(
            f"Not a fedsplit model id (expected kind/task/shape/outputs/hidden[/norm], e.g. "
            f"'mlp/classification/30/2/64-32', or 'recipe:' + JSON). Received: {model_id[:120]!r}"
        ) from e
    from fedsplit.protocol.selection import selection_metric

    return ModelIdentity(builtin_identity(kind, widths if kind == "mlp" else (), norm), task,
                         dims, count, selection_metric(task))


def describe_model(model_id: str | None) -> ModelIdentity | None:
    """`model_identity`, or None for no id or one that is not a model id (old or foreign files)."""
    if not model_id:
        return None
    try:
        return model_identity(model_id)
    except ConfigError:
        return None


def model_selection(model_id: str | None) -> str | None:
    """The metric a model's rounds are kept by, for any model id (a recipe's own, ``accuracy``
    or ``r2`` for the built-ins); None when there is no id or it says no task fedsplit knows. A
    short id is read by its task alone (``kind/task/...``), as older runs wrote them."""
    found = describe_model(model_id)
    if found is not None:
        return found.selection
    parts = str(model_id or "").split("/")
    if not is_recipe_id(str(model_id or "")) and len(parts) > 1:
        with contextlib.suppress(ConfigError):  # a task kind's name: its selection metric
            return task_kind(parts[1]).selection
    return None


@dataclass(frozen=True)
class RecipeReference:
    """Where a recipe's code is: ``module:attribute``, or an entry point's name."""

    text: str
    module: str = ""
    attribute: str = ""
    entry_point: str = ""


def parse_reference(text: str) -> RecipeReference:
    """``package.module:Attr`` or an entry-point name of the ``fedsplit.recipes`` group."""
    text = text.strip()
    if MODULE_REF.match(text):
        module, attribute = text.split(":", 1)
        return RecipeReference(text, module=module, attribute=attribute)
    if NAME.match(text):
        return RecipeReference(text, entry_point=text)
    raise ConfigError(
        f"--recipe is 'package.module:Attribute' (e.g. my_recipes.xray:ChestXray) or the name of "
        f"an installed entry point of the {ENTRY_POINT_GROUP!r} group (e.g. mlp). "
        f"Received: {text!r}"
    )


def parse_params(text: str | Mapping[str, Any] | None, *, where: str = "--recipe-params"
                 ) -> dict[str, Any]:
    """Recipe parameters as a dict: a JSON object string (``{}`` when empty) or a mapping."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where} must be a JSON object, e.g. '{{\"width\": 32}}'. ({e}) "
                          f"Received: {text!r}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object, e.g. '{{\"width\": 32}}'. "
                          f"Received: {text!r}")
    return value
