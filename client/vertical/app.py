"""The feature site of a vertical federation: a Flower ClientApp around `client.vertical.site`.

The site's file comes from the node config ``data-path`` (deployment) or entry ``partition-id``
of the run config's ``site-files`` (simulation). Every message is answered by
`SiteAgent.handle`, which checks both directions against `protocol.vertical.wire.ALLOWED`;
what must survive between messages lives in ``context.state``.
"""

from __future__ import annotations

import json

import torch
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.policy import policy_mod
from fedsplit.client.vertical.site import SiteAgent, SiteState
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.vertical.config import VerticalConfig
from fedsplit.protocol.vertical.wire import c_order, from_record, to_record
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

torch.set_num_threads(1)

app = ClientApp(mods=[policy_mod("vertical")])  # the hospital's policy and egress log


def _agent(context: Context) -> SiteAgent:
    cfg = VerticalConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    index = node.partition_id if node.partition_id is not None else -1
    path = node.data_path or cfg.site_entry("site-files", index)
    if not path:
        raise ConfigError("This site has no data file: give the SuperNode --node-config "
                          "'data-path=\"...\"'. Received: no data-path")
    out = node.out_dir or cfg.site_entry("site-out-dirs", index)
    name = node.site_name or f"site-{index if index >= 0 else context.node_id}"
    return SiteAgent(path, cfg.id_column, name, out)


def _load(context: Context) -> SiteState:
    state = SiteState()
    if "vertical-config" in context.state.config_records:
        state.config = json.loads(str(context.state.config_records["vertical-config"]["json"]))
    if "vertical-arrays" in context.state.array_records:
        state.arrays = {k: v.numpy() for k, v in context.state.array_records["vertical-arrays"].items()}
    return state


def _save(context: Context, state: SiteState) -> None:
    context.state["vertical-config"] = ConfigRecord({"json": json.dumps(state.config)})
    context.state["vertical-arrays"] = ArrayRecord(
        {k: Array(c_order(v)) for k, v in state.arrays.items()})


def _answer(message_type: str, msg: Message, context: Context) -> Message:
    state = _load(context)
    reply = _agent(context).handle(message_type, from_record(msg.content), state)
    _save(context, state)
    return Message(to_record(reply), reply_to=msg)


@app.query("psi_start")
def psi_start(msg: Message, context: Context) -> Message:
    """PSI step 1-2: send my encrypted IDs and re-encrypt the label holder's."""
    return _answer("query.psi_start", msg, context)


@app.query("psi_finish")
def psi_finish(msg: Message, context: Context) -> Message:
    """PSI step 3: find my shared rows in the agreed order."""
    return _answer("query.psi_finish", msg, context)


@app.query("prepare")
def prepare(msg: Message, context: Context) -> Message:
    """Fit imputation and scaling on my training rows; build my branch."""
    return _answer("query.prepare", msg, context)


@app.train("step")
def step(msg: Message, context: Context) -> Message:
    """Apply last step's embedding gradient; embed this step's rows."""
    return _answer("train.step", msg, context)


@app.query("embed")
def embed(msg: Message, context: Context) -> Message:
    """Embeddings of aligned rows (evaluation, neighbour search)."""
    return _answer("query.embed", msg, context)


@app.query("save")
def save(msg: Message, context: Context) -> Message:
    """Save my branch and preprocessing for `fedsplit vertical predict`."""
    return _answer("query.save", msg, context)
