"""Finding a recipe's code: ``module:attribute``, an entry point, or a built-in name.

`load_recipe` imports what the operator installed (a module on the path, or a package that
registers an entry point in the ``fedsplit.recipes`` group) and validates its parameters. Every
recipe class loaded in a process is remembered by name (`known`), so a model id naming that
recipe can be rebuilt there (`recipe_for`); a model id naming a recipe this process never loaded
is refused with the fix (``--recipe``): code is never imported because a message named it.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

from fedsplit.client.recipes.base import METRIC_NAME, Recipe, check_recipe_class
from fedsplit.client.recipes.builtin import BUILTINS
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import (
    ENTRY_POINT_GROUP,
    RecipeIdentity,
    keeps_short_id,
    parse_params,
    parse_reference,
)

_KNOWN: dict[str, type[Recipe]] = {}


def _entry_point(name: str) -> Any:
    found = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        installed = sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)})
        raise ConfigError(
            f"No recipe named {name!r}: it is neither built in ({', '.join(BUILTINS)}) nor an "
            f"installed entry point of the {ENTRY_POINT_GROUP!r} group (installed: "
            f"{installed or 'none'}). Install the package that provides it, or give "
            f"--recipe package.module:Attribute. Received: {name!r}"
        )
    try:
        return found[0].load()
    except Exception as e:  # the package's own import error, reported with its name
        raise ConfigError(f"Entry point {name!r} ({found[0].value}) failed to import: "
                          f"{type(e).__name__}: {e}. Received: {name!r}") from e


def recipe_class(reference: str) -> type[Recipe]:
    """The recipe class a reference points to (``module:Attr``, entry point or built-in)."""
    ref = parse_reference(reference)
    if ref.entry_point:
        cls = BUILTINS.get(ref.entry_point) or _entry_point(ref.entry_point)
    else:
        try:
            module = importlib.import_module(ref.module)
        except ImportError as e:
            raise ConfigError(
                f"Cannot import recipe module {ref.module!r} ({e}). Install the recipe's package "
                f"(or add its folder to PYTHONPATH) on this machine. Received: {reference!r}"
            ) from e
        cls = module
        for part in ref.attribute.split("."):
            if not hasattr(cls, part):
                raise ConfigError(f"Module {ref.module!r} has no attribute {ref.attribute!r}. "
                                  f"Received: {reference!r}")
            cls = getattr(cls, part)
        if isinstance(cls, Recipe):  # an instance: its class
            cls = type(cls)
    cls = check_recipe_class(cls, f"--recipe {reference}")
    if cls.name in BUILTINS and cls is not BUILTINS[cls.name]:
        raise ConfigError(f"Recipe name {cls.name!r} belongs to a built-in recipe; give yours "
                          f"another name. Received: {reference!r}")
    remember(cls)
    return cls


def remember(cls: type[Recipe]) -> None:
    """Make ``cls`` the recipe this process rebuilds models of ``cls.name`` with when no recipe
    is given (the last one loaded; a party's own recipe, when given, is always the one used)."""
    _KNOWN[cls.name] = cls


def load_recipe(reference: str, params: str | dict[str, Any] | None = None) -> Recipe:
    """Import the recipe ``reference`` names and validate ``params`` (JSON object or dict)."""
    cls = recipe_class(reference)
    recipe = cls(parse_params(params))
    bad = [n for t in cls.tasks for n in recipe.metric_names(t) if not METRIC_NAME.match(n)]
    if bad:
        raise ConfigError(f"Recipe {cls.name}: metric names are 1-40 lower-case letters, digits, "
                          f"'_' or '-' (they travel as Flower metrics). Received: {bad}")
    return recipe


def recipe_for(identity: RecipeIdentity, given: Recipe | None = None, *,
               strict: bool = False, where: str = "this model") -> Recipe:
    """The recipe that rebuilds a model made by ``identity``.

    ``given`` (this party's own recipe) must have the same name and version; with ``strict`` also
    the same parameters (a hospital training the federation's model). Otherwise the recipe class
    loaded in this process under that name is used, with the parameters ``identity`` records.
    """
    if given is not None:
        mine = given.identity
        differs = mine.differences(identity)
        if differs and (strict or mine.name != identity.name or mine.version != identity.version):
            raise ConfigError(
                f"{where} was built by recipe {identity.label()} with params {identity.params}, but "
                f"this party runs {mine.label()} with params {mine.params} ({'; '.join(differs)}). "
                f"Install and select the same recipe (--recipe, --recipe-params). Received: "
                f"{mine.to_json()}"
            )
        return given if not differs else type(given)(identity.params)
    cls = BUILTINS.get(identity.name) or _KNOWN.get(identity.name)
    if cls is None:
        raise ConfigError(
            f"{where} was built by recipe {identity.label()}, which this process has not loaded. "
            f"Pass --recipe with that recipe's module:Attribute or entry point (installed here). "
            f"Received: recipe {identity.name!r}"
        )
    if cls.version != identity.version:
        raise ConfigError(f"{where} was built by recipe {identity.label()}, but the installed "
                          f"{cls.name} is version {cls.version}. Install version "
                          f"{identity.version}. Received: {cls.version!r}")
    return cls(identity.params)


def recipe_to_build(identity: RecipeIdentity | None, own: Recipe | None, *,
                    where: str = "The federation's model") -> Recipe:
    """The recipe with which this hospital builds a model the coordinator names: a built-in
    recipe from its identity (whatever this hospital runs); any other (``identity`` None: the
    hospitals' own recipe, as ``query.init`` asks) is this hospital's own recipe ``own``, which
    must have the same name, version and parameters; a hospital that runs none is refused with
    the fix."""
    if identity is not None and keeps_short_id(identity):
        return recipe_for(identity, where=where)
    if own is None:
        named = f"recipe {identity.label()}" if identity is not None else "the hospitals' recipe"
        raise ConfigError(
            f"{where} is built by {named}, but this hospital runs no recipe. Start it with "
            f"--recipe (node config recipe). Received: "
            f"{identity.to_json() if identity is not None else 'kind=recipe'}"
        )
    return own if identity is None else recipe_for(identity, own, strict=True, where=where)


#: Recipes fedsplit bundles beyond the built-ins, found by name without --recipe (by name:
#: their code loads only when a model names them)
BUNDLED = {"cox": "fedsplit.client.survival.recipe:Cox"}


def recipe_to_score(identity: RecipeIdentity, given: Recipe | None, *, where: str) -> Recipe | None:
    """The recipe ``fedsplit predict`` scores a saved model with: ``given`` (--recipe); else a
    bundled recipe the model names (`BUNDLED`); None for a built-in (`client.models.build_model`
    finds it); any other recipe is refused, naming it and the fix (--recipe)."""
    if given is not None:
        return given
    if keeps_short_id(identity):
        return None
    if identity.name in BUNDLED:
        return load_recipe(BUNDLED[identity.name])
    raise ConfigError(f"{where} was trained with recipe {identity.label()}; pass --recipe with "
                      f"that recipe (installed here) to rebuild and score it. Received: no --recipe")
