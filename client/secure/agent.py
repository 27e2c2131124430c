"""What the hospital agent does under secure aggregation (`client/app.py` calls it).

The ``query.secagg`` handler answers the setup, share-keys and unmask stages; a train
instruction carrying a ``secagg`` record is the collect stage: the agent trains as usual, then
replies with its masked, count-weighted change instead of its weights (`secure_train_reply`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fedsplit.client.secure import secagg
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.errors import ConfigError, FederationError, UpdateError
from fedsplit.protocol.update import Update

UPDATE = "secagg-update"  # Context.state array record: this round's change
UPDATE_COUNT = "secagg-update-count"  # Context.state config record: its count


def handle_query(content: Any, node_id: int, context: Any) -> Any:
    """Answer a ``query.secagg`` instruction; return the reply's ``RecordDict``."""
    from flwr.app import ConfigRecord, RecordDict

    if list(content.keys()) != [pv.SECAGG] or pv.SECAGG not in content.config_records:
        raise ConfigError(f"A query.secagg instruction holds one config record {pv.SECAGG!r}. "
                          f"Received: {list(content.keys())}")
    config = dict(content.config_records[pv.SECAGG])
    stage = str(config.get(pv.STAGE))
    pv.check_secagg_record(config, stage, reply=False)
    if stage == pv.SETUP:
        reply = secagg.setup(context, node_id, config)
    elif stage == pv.SHARE:
        reply = secagg.share_keys(context, config)
    elif stage == pv.POINT:
        reply = {"masked": weiszfeld_masked(context, config).tobytes()}
    elif stage == pv.UNMASK:
        reply = secagg.unmask(context, config)
    else:
        raise ConfigError(f"The collect stage comes with the train instruction, not a query. "
                          f"Received: stage={stage!r}")
    pv.check_secagg_record(reply, stage, reply=True)
    return RecordDict({pv.SECAGG: ConfigRecord(reply)})


def weiszfeld_masked(context: Any, config: dict[str, Any]) -> np.ndarray:
    """A Weiszfeld step's collect stage: this hospital's masked
    ``[a_k q(d_k), a_k, n_k, n_k dist_k]`` for the broadcast point (`sv.encode_weiszfeld`)."""
    state = secagg._state(context)
    if not state or UPDATE not in context.state.array_records:
        raise FederationError("A Weiszfeld step arrived but this hospital holds no secure "
                              "update of this round (it did not train, or set up no keys). "
                              "Received: stage point")
    delta = {k: a.numpy() for k, a in context.state.array_records[UPDATE].items()}
    count = int(context.state.config_records[UPDATE_COUNT]["count"])
    point = np.frombuffer(bytes(config["point"]), dtype=np.float64)
    vector = sv.encode_weiszfeld(delta, count, point, float(config["scale"]), float(config["nu"]),
                                 float(state["bound"]), int(state["levels"]))
    return secagg.masked_vector(context, config, vector)


def take_secure_record(content: Any) -> dict[str, Any] | None:
    """Remove and return a train instruction's ``secagg`` record (None when not secure)."""
    if pv.SECAGG not in content.config_records:
        return None
    record = dict(content.config_records[pv.SECAGG])
    del content[pv.SECAGG]
    pv.check_secagg_record(record, pv.COLLECT, reply=False)
    return record


def train_reply(secure: Mapping[str, Any] | None, context: Any, start: Mapping[str, np.ndarray],
                update: Update, metrics: Mapping[str, Any], site_info: Mapping[str, str], *,
                evaluation: Mapping[str, Any] | None = None,
                metrics_allowed: Sequence[str] = ()) -> Any:
    """The train reply: plain (weights and count, `protocol.horizontal_wire`) or, when the
    instruction carried a ``secagg`` record, masked (`secure_train_reply`); either carries the
    received model's ``evaluation`` when the instruction said ``evaluate-first``."""
    if secure is None:
        return wire.build_train_reply(update, metrics, site_info, evaluation=evaluation,
                                      metrics_allowed=metrics_allowed)
    return secure_train_reply(secure, context, start, update.arrays, update.num_examples,
                              metrics, site_info, evaluation=evaluation,
                              metrics_allowed=metrics_allowed)


def secure_train_reply(record: Mapping[str, Any], context: Any, start: Mapping[str, np.ndarray],
                       trained: Mapping[str, np.ndarray], num_examples: int,
                       metrics: Mapping[str, Any], site_info: Mapping[str, str], *,
                       evaluation: Mapping[str, Any] | None = None,
                       metrics_allowed: Sequence[str] = ()) -> Any:
    """The masked train reply: ``masked`` (one int64 vector), metrics and site; no weights and
    no count (the count travels inside the masked vector). ``evaluation``: the received model's
    scores on the validation rows (``evaluate-first``), in the clear as in a plain reply (and as
    an evaluate reply's would be)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    state = secagg._state(context)
    if not state:
        raise FederationError("A secure train instruction arrived but this hospital holds no "
                              "secure-aggregation keys for the round (setup and share-keys did "
                              "not reach it). Received: stage collect without setup")
    if set(start) != set(trained):
        raise UpdateError(f"The trained model's arrays differ from the global model's. "
                          f"Received: {sorted(set(start) ^ set(trained))}")
    # np.subtract of two 0-d arrays is a numpy scalar: keep every change an array (0-d stays 0-d);
    # running statistics relative to their size (`sv.relative_scale`, undone by the coordinator)
    scale = sv.relative_scale(start)
    delta = {k: np.asarray((np.asarray(trained[k], np.float64) - np.asarray(start[k], np.float64))
                           / scale.get(k, 1.0)) for k in start}
    vector = sv.encode(delta, int(num_examples), float(state["bound"]), int(state["levels"]))
    masked = secagg.masked_vector(context, record, vector)
    # kept for the Weiszfeld steps of a secure geometric median (never sent unmasked)
    context.state.array_records[UPDATE] = ArrayRecord({k: Array(v) for k, v in delta.items()})
    context.state.config_records[UPDATE_COUNT] = ConfigRecord({"count": int(num_examples)})
    values = {k: (int(v) if isinstance(v, int) else float(v)) for k, v in metrics.items()
              if k != wire.NUM_EXAMPLES}
    records = {pv.MASKED: ArrayRecord({"vector": Array(masked)}),
               "metrics": MetricRecord(values),
               "site": ConfigRecord({k: str(v) for k, v in site_info.items()}),
               pv.SECAGG: ConfigRecord({pv.STAGE: pv.COLLECT})}
    if evaluation is not None:
        records[wire.EVALUATION] = wire.evaluation_record(evaluation, metrics_allowed)
    return RecordDict(records)
