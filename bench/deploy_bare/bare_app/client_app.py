"""The bare ClientApp: a torch logistic regression on the hospital's CSV (last column the
label), trained a few epochs per round and scored on 20% held-out rows. It imports torch at
start like fedsplit's agent, so both pay the same process start per message."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

torch.set_num_threads(1)
app = ClientApp()


def _data(context: Context) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = np.loadtxt(str(context.node_config["data-path"]), delimiter=",", skiprows=1)
    x, y = rows[:, :-1], rows[:, -1]
    x = (x - x.mean(0)) / (x.std(0) + 1e-9)
    cut = int(len(x) * 0.8)
    t = [torch.tensor(a, dtype=torch.float32) for a in (x[:cut], y[:cut], x[cut:], y[cut:])]
    return t[0], t[1], t[2], t[3]


def _model(msg: Message) -> torch.nn.Linear:
    model = torch.nn.Linear(30, 1)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


@app.train()
def train(msg: Message, context: Context) -> Message:
    x, y, _, _ = _data(context)
    model = _model(msg)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss = torch.tensor(0.0)
    for _ in range(10):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
        loss.backward()
        opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"train-loss": float(loss),
                                                        "num-examples": len(x)})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, _, x, y = _data(context)
    model = _model(msg)
    with torch.no_grad():
        accuracy = float(((model(x).squeeze(1) > 0).float() == y).float().mean())
    return Message(RecordDict({"metrics": MetricRecord({"accuracy": accuracy,
                                                        "num-examples": len(x)})}), reply_to=msg)
