"""Score a raw hospital table with a saved global model and the schema stored beside it.

``fedsplit predict --model global.h5 PATIENTS.csv -o PREDICTIONS.csv``: the table is read as it
comes and encoded with the model's own schema (`protocol.schema.encode_frame`, the encoding every
hospital used in training). Unknown columns are refused with the column named (the target, the
ID column and the schema's ignored columns are allowed), as are missing columns and values of
the wrong kind; an unseen category takes the documented fallback (treated as missing). One
output row per input row: the ID column when the table has it, then ``p_<label>`` per class and
``predicted`` (the label), or ``predicted`` alone for regression.

A model trained with a recipe (`client.recipes`) is rebuilt with that recipe, which must be
installed here and named with ``--recipe`` (its version must be the one the weight file records;
the parameters come from the file). The recipe's `Recipe.predict` gives the output columns, and
its reader (`Recipe.read_inputs`) reads inputs that are not tables: ``fedsplit predict --model
global.h5 --recipe my_recipes:XRay FOLDER -o predictions.csv`` writes one row per image, named
by its file (column ``input``).

A survival model (the Cox recipe, ``fedsplit simulate --task survival``; the bundled recipe is
found without ``--recipe``) gives ``risk``, the log relative hazard. With ``times`` (``--times
365,730``) also ``survival_at_<t>`` per time: ``S(t | x) = exp(-H0(t) exp(risk))``, ``H0`` the
pooled Breslow cumulative hazard the run wrote beside the model (``global.baseline.json``,
`protocol.survival_summary.Baseline`; 0 before its first published time). Refused with the
reason: ``times`` for a model that is not a survival model, a missing baseline file or one
computed for another model file (sha256), a time that is not a positive number, and a time past
the baseline's last published time (nothing is known there: too few patients remain at risk).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedsplit.client.data import TABLE_SUFFIXES, read_table
from fedsplit.client.failures import describe
from fedsplit.client.models import load_model, recipe_of
from fedsplit.client.recipes import Recipe, load_recipe, recipe_to_score
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import describe_model
from fedsplit.protocol.schema import Schema, encode_frame
from fedsplit.protocol.tasks import task_kind
from fedsplit.protocol.weights import read_schema, read_weights


def predict_frame(model_path: Path, frame: Any, *, where: str, recipe: Recipe | None = None) -> Any:
    """The predictions for a raw table (a DataFrame), as a DataFrame of the same length."""
    import pandas as pd

    text = read_schema(model_path)
    if text is None:
        raise ConfigError(
            f"{model_path} stores no table schema, so raw files cannot be encoded for it (a model "
            f"for images, or one written before schemas travelled with models). Use a global.h5 "
            f"from a table federation. Received: {model_path}"
        )
    schema = Schema.from_json(text)
    model = load_model(model_path, recipe=recipe)
    x, _ = encode_frame(schema, frame, where=where, need_target=False, refuse_unknown=True)
    if x.shape[1] != model.spec.input_shape[0]:
        raise ConfigError(f"{model_path}: its schema gives {x.shape[1]} features but the model "
                          f"reads {model.spec.input_shape[0]}; the file is inconsistent. "
                          f"Received: {model.spec.to_id()}")
    columns = recipe_of(model).predict(model, x)
    out = pd.DataFrame(index=range(len(frame)))
    if schema.id_column and schema.id_column in frame.columns:
        out[schema.id_column] = frame[schema.id_column].to_numpy()
    if task_kind(schema.task).classes:  # class indices -> the schema's labels
        probs = [c for c in columns if c.startswith("p_") and c[2:].isdigit()]
        labels = list(schema.labels) + [f"class-{k}" for k in
                                        range(len(schema.labels), len(probs))]
        for name in probs:
            out[f"p_{labels[int(name[2:])]}"] = columns[name]
        out["predicted"] = [labels[int(k)] for k in columns["predicted"]]
        for name, values in columns.items():
            if name != "predicted" and name not in probs:
                out[name] = values
    else:
        for name, values in columns.items():
            out[name] = values
    return out


def predict_inputs(model_path: Path, source: Path, recipe: Recipe) -> Any:
    """The predictions for inputs that are not a table, read by ``recipe``'s reader (a folder of
    images, ...): one row per input, its id in column ``input``."""
    import pandas as pd

    model = load_model(model_path, recipe=recipe)
    try:  # the recipe's own reader, with the parameters the file records
        read = recipe_of(model).read_inputs(Path(source))
    except Exception as e:  # a hospital's reader may raise anything: one line, its code's line
        raise ConfigError(f"Recipe {recipe.name}'s reader could not read {source}: "
                          f"{describe(e)}. Give the inputs as the recipe reads them. "
                          f"Received: {source}") from e
    if read is None:
        raise ConfigError(f"Recipe {recipe.name} has no reader for {source} (and it is not a CSV "
                          f"or Parquet table). Give the inputs as the recipe reads them. "
                          f"Received: {source}")
    x, ids = read
    if tuple(x.shape[1:]) != tuple(model.spec.input_shape):
        raise ConfigError(f"{source}: the inputs have shape {tuple(x.shape[1:])} but the model "
                          f"reads {tuple(model.spec.input_shape)}. Received: {len(x)} inputs")
    try:
        columns = recipe_of(model).predict(model, x)
    except Exception as e:  # the recipe's own predict
        raise ConfigError(f"Recipe {recipe.name}'s predict failed on {source}: {describe(e)}. "
                          f"Received: {len(x)} inputs") from e
    return pd.DataFrame({"input": ids, **columns})


def survival_baseline(model_path: Path, model_id: str, times: Sequence[float],
                      baseline: Path | None = None) -> ss.Baseline:
    """The baseline that turns ``model_path``'s risk into survival at ``times``; refused for a
    model that is not a survival model, a missing or mismatched baseline, or times past it."""
    found_model = describe_model(model_id)
    task = found_model.task if found_model is not None else ""
    if not (task and task_kind(task).time_event):
        raise ConfigError(f"--times gives survival probabilities of a survival model (fedsplit "
                          f"simulate --task survival); {model_path} is a {task or 'unknown'} "
                          f"model. Leave --times out. Received: model {model_id[:80]!r}")
    path = Path(baseline) if baseline is not None else ss.baseline_path(Path(model_path))
    if not path.exists():
        raise ConfigError(f"--times needs the model's baseline hazard, {path.name} beside the "
                          f"model (written by the survival run after its last round), or "
                          f"--baseline PATH. Received: no file {path}")
    found = ss.Baseline.load(path)
    found.check_model(Path(model_path), str(path))
    found.hazard_at(times)  # refuses a time past the baseline before anything is scored
    return found


def add_survival(result: Any, found: ss.Baseline, times: Sequence[float]) -> Any:
    """``survival_at_<t>`` columns from the predictions' ``risk``."""
    if "risk" not in result.columns:
        raise ConfigError(f"The model's predictions have no 'risk' column, which --times needs. "
                          f"Received: columns {list(result.columns)}")
    probs = found.survival(result["risk"].to_numpy(dtype=float), times)
    for j, t in enumerate(times):
        result[ss.survival_column(t)] = probs[:, j]
    return result


def predict_file(model_path: Path, table: Path, output: Path, *, recipe: str = "",
                 times: Sequence[float] = (), baseline: Path | None = None) -> Any:
    """Score ``table`` (or, with a recipe that reads them, other inputs such as a folder of
    images) with the model in ``model_path``; write and return the predictions. ``times``:
    survival probabilities too (module docstring), from ``baseline`` (default: beside the
    model)."""
    if output.suffix.lower() not in (".csv", ".parquet"):
        raise ConfigError(f"-o must end in .csv or .parquet. Received: {output.name}")
    impl = load_recipe(recipe) if recipe else None
    table = Path(table)
    if not table.exists():
        raise ConfigError(f"The inputs to score, {table}, do not exist. Check the path. "
                          f"Received: {table}")
    model_id = read_weights(Path(model_path)).model or ""
    found = survival_baseline(Path(model_path), model_id, times, baseline) if times else None
    if (made := describe_model(model_id)) is not None:  # --recipe, bundled (cox) or built-in
        impl = recipe_to_score(made.recipe, impl, where=str(model_path))
    if impl is not None and (table.suffix.lower() not in TABLE_SUFFIXES
                             or read_schema(Path(model_path)) is None):  # the recipe read its tables
        result = predict_inputs(Path(model_path), table, impl)
    else:
        frame = read_table(table)
        result = predict_frame(Path(model_path), frame, where=str(table), recipe=impl)
    if found is not None:
        result = add_survival(result, found, times)
    with atomic_path(output) as tmp:  # never a half-written predictions file
        if output.suffix.lower() == ".csv":
            result.to_csv(tmp, index=False)
        else:
            result.to_parquet(tmp, index=False)
    return result
