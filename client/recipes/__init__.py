"""Recipes: a hospital's own model, loss, metrics, data reader and training step (docs/recipes.md).

Write a subclass of `Recipe`; point fedsplit to it with ``--recipe package.module:Attribute`` or
an entry point of the ``fedsplit.recipes`` group. The built-in MLP and CNN are recipes too
(`MLP`, `CNN`).
"""

from fedsplit.client.recipes.base import (
    NoParams,
    Recipe,
    Standardize,
    model_task,
)
from fedsplit.client.recipes.builtin import BUILTINS, CNN, MLP, builtin_recipe
from fedsplit.client.recipes.registry import (
    load_recipe,
    recipe_class,
    recipe_for,
    recipe_to_build,
    recipe_to_score,
    remember,
)
from fedsplit.client.recipes.spec import ModelInputs, ModelSpec

__all__ = [
    "BUILTINS",
    "CNN",
    "MLP",
    "ModelInputs",
    "ModelSpec",
    "NoParams",
    "Recipe",
    "Standardize",
    "builtin_recipe",
    "load_recipe",
    "model_task",
    "recipe_class",
    "recipe_for",
    "recipe_to_build",
    "recipe_to_score",
    "remember",
]
