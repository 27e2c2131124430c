"""What the hospital agent does under secure aggregation (`client/app.py` calls it).

The ``query.secagg`` handler answers the setup, share-keys and unmask stages; a train
instruction carrying a ``secagg`` record is the collect stage: the agent trains as usual, then
replies with its masked, count-weighted change instead of its weights (`secure_train_reply`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from client.secure import secagg
from protocol import privacy as pv
from protocol import secure_vector as sv
from protocol.errors import ConfigError


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
    elif stage == pv.UNMASK:
        reply = secagg.unmask(context, config)
    else:
        raise ConfigError(f"The collect stage comes with the train instruction, not a query. "
                          f"Received: stage={stage!r}")
    pv.check_secagg_record(reply, stage, reply=True)
    return RecordDict({pv.SECAGG: ConfigRecord(reply)})


def take_secure_record(content: Any) -> dict[str, Any] | None:
    """Remove and return a train instruction's ``secagg`` record (None when not secure)."""
    if pv.SECAGG not in content.config_records:
        return None
    record = dict(content.config_records[pv.SECAGG])
    del content[pv.SECAGG]
    pv.check_secagg_record(record, pv.COLLECT, reply=False)
    return record


def secure_train_reply(record: Mapping[str, Any], context: Any, start: Mapping[str, np.ndarray],
                       trained: Mapping[str, np.ndarray], num_examples: int,
                       metrics: Mapping[str, Any], site_info: Mapping[str, str]) -> Any:
    """The masked train reply: ``masked`` (one int64 vector), metrics and site, no weights."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    state = secagg._state(context)
    delta = {k: np.asarray(trained[k], np.float64) - np.asarray(start[k], np.float64)
             for k in start}
    vector = sv.encode(delta, int(num_examples), float(state["bound"]), int(state["levels"]))
    masked = secagg.masked_vector(context, record, vector)
    values = {k: (int(v) if isinstance(v, int) else float(v)) for k, v in metrics.items()}
    return RecordDict({pv.MASKED: ArrayRecord({"vector": Array(masked)}),
                       "metrics": MetricRecord({"num-examples": int(num_examples), **values}),
                       "site": ConfigRecord({k: str(v) for k, v in site_info.items()}),
                       pv.SECAGG: ConfigRecord({pv.STAGE: pv.COLLECT})})
