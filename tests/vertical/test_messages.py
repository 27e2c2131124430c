"""Only PSI points, positions, embeddings and gradients cross the network: inspect every message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.orchestration.vertical.local import local_coordinator
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.protocol.vertical.wire import ALLOWED, Payload, check_payload
from fedsplit.server.vertical.coordinator import read_label_file


def _record_bytes(record) -> bytes:
    parts = [str(dict(cfg)).encode() for cfg in record.config_records.values()]
    for arrays in record.array_records.values():
        parts += [np.ascontiguousarray(a.numpy()).tobytes() for a in arrays.values()]
    return b"".join(parts)


def test_messages_carry_no_rows_labels_or_ids(tmp_path: Path, rng: np.random.Generator) -> None:
    n = 120
    ids = [f"SECRET-PATIENT-{i:05d}" for i in range(n)]
    marker = 98765.4321 + np.arange(n)  # distinctive raw values
    target = 5000.125 + 3.5 * np.arange(n)  # distinctive labels
    pd.DataFrame({"pid": ids, "a": marker, "cat": rng.choice(["RAREWORD", "OTHERWORD"], n)}).to_csv(
        tmp_path / "a.csv", index=False)
    pd.DataFrame({"pid": ids[::-1], "b": rng.normal(size=n)}).to_csv(tmp_path / "b.csv", index=False)
    pd.DataFrame({"pid": ids, "y": target}).to_csv(tmp_path / "y.csv", index=False)
    labels = read_label_file(str(tmp_path / "y.csv"), "pid", "y", "regression")
    coord, transport = local_coordinator(labels, [tmp_path / "a.csv", tmp_path / "b.csv"], "pid",
                                         FusionParams(steps_per_round=4, batch_size=16), keep=True)
    coord.align()
    coord.prepare()
    coord.train_round()
    coord.evaluate()
    seen_types = {t for t, *_ in transport.log}
    assert seen_types == {"query.psi_start", "query.psi_finish", "query.prepare", "train.step", "query.embed"}
    forbidden = [i.encode() for i in ids] + [b"RAREWORD", b"OTHERWORD", b"pid"]
    forbidden += [np.float64(v).tobytes() for v in [*marker, *target]]
    forbidden += [np.float32(v).tobytes() for v in [*marker, *target]]
    for message_type, direction, _, record in transport.log:
        names = set(record.array_records["arrays"].keys())
        allowed = ALLOWED[message_type][direction == "from-site"]
        assert names <= allowed, (message_type, direction, names)
        blob = _record_bytes(record)
        for token in forbidden:
            assert token not in blob, (message_type, direction, token[:20])
        for name, arr in record.array_records["arrays"].items():
            a = arr.numpy()
            if name in ("embeddings", "gradients"):
                assert a.dtype == np.float32 and a.shape[1] == coord.p.embedding_dim


def test_a_reply_with_anything_else_is_refused() -> None:
    leak = Payload(arrays={"embeddings": np.zeros((2, 4), np.float32), "features": np.zeros((2, 3))})
    with pytest.raises(ConfigError, match=r"may carry only.*Received: \['features'\]"):
        check_payload("train.step", leak, reply=True)
