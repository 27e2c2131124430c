"""One identity for every model id (`protocol.recipe.model_identity`): short built-in ids and
``recipe:`` ids read the same way, byte-identical ids round-trip through `ModelSpec`."""

from __future__ import annotations

import pytest
from fedsplit.client.recipes import MLP, ModelInputs, ModelSpec
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import describe_model, model_identity, model_selection
from fedsplit.protocol.survival_exact import cox_params

SHORT = ["mlp/classification/30/2/64-32", "mlp/regression/13/1/-/batch", "cnn/classification/1x8x8/10/-"]


@pytest.mark.parametrize("model_id", SHORT)
def test_short_ids_read_as_their_builtin_recipe(model_id: str) -> None:
    found = model_identity(model_id)
    spec = ModelSpec.from_id(model_id)
    assert found.recipe == spec.identity and found.short_id
    assert (found.task, found.input_shape, found.num_outputs) == (spec.task, spec.input_shape,
                                                                 spec.num_outputs)
    assert found.selection == ("accuracy" if spec.task == "classification" else "r2")
    assert spec.to_id() == model_id  # ids unchanged, byte for byte


def test_recipe_ids_and_selection() -> None:
    spec = MLP({"hidden": [8]}).model_spec(ModelInputs("classification", (4,), 2))
    assert model_identity(spec.to_id()).recipe.params == {"hidden": [8], "norm": "none"}
    rid = ('recipe:{"input_shape":[4],"name":"cox","num_outputs":1,"params":{"hidden":[]},'
           '"selection":"c_index","task":"survival","version":"1"}')
    assert model_selection(rid) == "c_index" and not model_identity(rid).short_id
    assert cox_params(rid) == {"hidden": []} and cox_params(SHORT[0]) is None
    assert model_selection("mlp/classification") == "accuracy"  # an old id read by its task
    assert model_selection(None) is None and model_selection("junk") is None
    assert describe_model("recipe:{bad") is None
    with pytest.raises(ConfigError, match="Not a fedsplit model id"):
        model_identity("svm/classification/3/2/-")
