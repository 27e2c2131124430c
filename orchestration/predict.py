"""Score a raw hospital table with a saved global model and the schema stored beside it.

``fedsplit predict --model global.h5 PATIENTS.csv -o PREDICTIONS.csv``: the table is read as it
comes and encoded with the model's own schema (`protocol.schema.encode_frame`, the encoding every
hospital used in training). Unknown columns are refused with the column named (the target, the
ID column and the schema's ignored columns are allowed), as are missing columns and values of
the wrong kind; an unseen category takes the documented fallback (treated as missing). One
output row per input row: the ID column when the table has it, then ``p_<label>`` per class and
``predicted`` (the label), or ``predicted`` alone for regression.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from fedsplit.client.data import read_table
from fedsplit.client.models import load_model
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import Schema, encode_frame
from fedsplit.protocol.weights import read_schema


def predict_frame(model_path: Path, frame: Any, *, where: str) -> Any:
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
    model = load_model(model_path)
    x, _ = encode_frame(schema, frame, where=where, need_target=False, refuse_unknown=True)
    if x.shape[1] != model.spec.input_shape[0]:
        raise ConfigError(f"{model_path}: its schema gives {x.shape[1]} features but the model "
                          f"reads {model.spec.input_shape[0]}; the file is inconsistent. "
                          f"Received: {model.spec.to_id()}")
    model.eval()
    with torch.no_grad():
        xt = torch.as_tensor(x, dtype=torch.float32)
        out = pd.DataFrame(index=range(len(frame)))
        if schema.id_column and schema.id_column in frame.columns:
            out[schema.id_column] = frame[schema.id_column].to_numpy()
        if schema.task == "classification":
            probs = torch.softmax(model(xt), dim=1).numpy().astype(np.float64)
            labels = list(schema.labels) + [f"class-{k}" for k in
                                            range(len(schema.labels), probs.shape[1])]
            for k, label in enumerate(labels):
                out[f"p_{label}"] = probs[:, k]
            out["predicted"] = [labels[k] for k in probs.argmax(axis=1)]
        else:
            out["predicted"] = model.predict(xt).numpy().astype(np.float64)
    return out


def predict_file(model_path: Path, table: Path, output: Path) -> Any:
    """Score ``table`` with the model in ``model_path``; write and return the predictions."""
    if output.suffix.lower() not in (".csv", ".parquet"):
        raise ConfigError(f"-o must end in .csv or .parquet. Received: {output.name}")
    frame = read_table(Path(table))
    result = predict_frame(Path(model_path), frame, where=str(table))
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix.lower() == ".csv":
        result.to_csv(output, index=False)
    else:
        result.to_parquet(output, index=False)
    return result
