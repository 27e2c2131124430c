"""What the hospital's own checks cost per message (issue 40): the policy mod with its egress log
(and the privacy ledger's count of a plain training) around fedsplit's train handler.

Measured in one process on one hospital (120 breast-cancer rows, the built-in MLP): the whole
train message through the ClientApp (its mods included), against the mod's own work alone (the
same message and reply, the handler replaced by returning that reply). Printed: the median of
each over ``--repeats`` messages and their ratio. In deployment every message is a new process
that imports torch and trains (seconds); the mod's share of a round is this ratio or less.

    .venv/bin/python bench/hospital_policy_overhead.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
from fedsplit.client.app import app
from fedsplit.client.data import load_bundled
from fedsplit.client.models import build_model
from fedsplit.client.policy import policy_mod
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.update import state_dict_arrays, to_array_record
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

MODEL_ID = "mlp/classification/30/2/64-32"
NODE_ID = 7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="policy-overhead-"))
    data = load_bundled("breast-cancer")
    frame = pd.DataFrame(data.x[:120], columns=data.feature_names)
    frame["diagnosis"] = data.y[:120]
    frame.to_csv(work / "hospital.csv", index=False)
    cfg = RunConfig(target="diagnosis", local_steps=10)
    ctx = Context(run_id=1, node_id=NODE_ID, state=RecordDict(), run_config=cfg.to_flower(),
                  node_config={"data-path": str(work / "hospital.csv"), "site-name": "h1",
                               "state-dir": str(work / "state")})
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, NODE_ID, 1
    arrays = to_array_record(state_dict_arrays(build_model(MODEL_ID, seed=0).state_dict()))

    def message(server_round: int) -> Message:
        return Message(RecordDict({"config": ConfigRecord({"server-round": server_round,
                                                           "model-id": MODEL_ID}),
                                   "arrays": arrays}),
                       dst_node_id=NODE_ID, message_type="train", group_id=str(server_round))

    # the schema's statistics first, as a round-1 hospital has them (query.setup)
    app(Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=NODE_ID,
                message_type="query.setup"), ctx)
    whole, mod_only = [], []
    reply = None
    mod = policy_mod("horizontal")
    for r in range(1, args.repeats + 1):
        start = time.perf_counter()
        reply = app(message(r), ctx)
        whole.append(time.perf_counter() - start)
        if reply.has_error():
            raise SystemExit(f"the train message failed: {reply.error.reason}")
        start = time.perf_counter()
        mod(message(r), ctx, lambda _m, _c, done=reply: done)
        mod_only.append(time.perf_counter() - start)
    w, m = statistics.median(whole), statistics.median(mod_only)
    print(f"train message through the ClientApp (mods included): median {w * 1000:.1f} ms")
    print(f"the policy mod alone (checks, classification, egress log): median {m * 1000:.1f} ms")
    print(f"ratio mod / whole message: {m / w:.3f}  ({args.repeats} messages, {work})")


if __name__ == "__main__":
    main()
