"""The coordinator names the hospital that runs another recipe, whatever order replies arrive in."""

from __future__ import annotations

import itertools

import pytest
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import RecipeIdentity, check_same_recipe


@pytest.mark.parametrize("order", list(itertools.permutations(["a", "b", "odd"])))
def test_the_minority_hospital_is_named_in_any_reply_order(order: tuple[str, ...]) -> None:
    same = RecipeIdentity(name="png-cnn", version="1.0", params={"channels": 16})
    other = RecipeIdentity(name="png-cnn", version="1.1", params={"channels": 16})
    sites = {name: other if name == "odd" else same for name in order}
    with pytest.raises(ConfigError) as err:
        check_same_recipe(sites)
    message = str(err.value)
    assert "hospital odd runs png-cnn version 1.1 (version '1.1' vs '1.0')" in message
    assert "hospital a runs png-cnn version 1.0 (" not in message


def test_all_alike_returns_the_recipe() -> None:
    same = RecipeIdentity(name="png-cnn", version="1.0")
    assert check_same_recipe({"a": same, "b": same}) == same
