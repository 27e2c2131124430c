"""Is the coordinator's round loop slower than at an earlier commit? Paired runs, in process.

The deployment bench (`bench/deploy_rounds.py`) measures whole rounds, which on a shared
machine move by more than the loop costs. This one times only the coordinator's side: the run's
loop as the ServerApp builds it from the run config (plain, or ``--secure`` for secure
aggregation), over scripted hospitals answering in the same process (a Flower ``Grid`` whose
``send_and_receive`` answers each instruction at once: train replies move the model a little
and carry the received model's scores when the instruction says ``evaluate-first``, evaluate
replies score, secure-aggregation stages are the hospital agent's own code). Each run is a
fresh interpreter with the checkout's folder first on ``sys.path``; the earlier checkout's
runs and this one's alternate, and each prints the loop's wall and CPU time (history and
model files written as in a real run).

Both loops are driven through what their ServerApp calls: ``compose_loop(...).run(...)``
here, ``run_rounds(compose_strategy(...), ...)`` before issue 42.

    git worktree add /tmp/before <rev>
    .venv/bin/python bench/loop_rounds.py --before /tmp/before --rounds 10 --repeats 5
    .venv/bin/python bench/loop_rounds.py --before /tmp/before --secure --params 100000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = r'''
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedsplit.client.secure import agent
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol.config import RunConfig
from fedsplit.server import compose, rounds
from fedsplit.server.compose import compose_aggregator
from fedsplit.server.history import RunHistory

hospitals, params, num_rounds, secure = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                         sys.argv[4] == "1")
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
MODEL = "mlp/classification/2/2/-"


class Context:
    def __init__(self):
        self.state = RecordDict()


class Hospitals:
    def __init__(self, n):
        self.nodes = list(range(1, n + 1))
        self.contexts = {k: Context() for k in self.nodes}
        self.rng = np.random.default_rng(0)

    def get_node_ids(self):
        return list(self.nodes)

    def answer(self, msg):
        node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
        if kind == pv.SECAGG_QUERY:
            return Message(agent.handle_query(msg.content, node, self.contexts[node]), reply_to=msg)
        record = agent.take_secure_record(msg.content) if kind == wire.TRAIN else None
        config = msg.content.config_records["config"]
        start = {k: a.numpy() for k, a in msg.content.array_records["arrays"].items()}
        scores = {wire.NUM_EXAMPLES: 50 + node, "accuracy": 0.5, "loss": 1.0}
        if kind == wire.EVALUATE:
            return Message(wire.build_evaluate_reply(scores, {"name": f"h{node}"}), reply_to=msg)
        first = bool(config.get(wire.EVALUATE_FIRST, False))
        trained = {k: (v + 1e-3 * node).astype(v.dtype) for k, v in start.items()}
        metrics = {wire.TRAIN_LOSS: 0.5}
        if record is None:
            reply = wire.build_train_reply(trained, {wire.NUM_EXAMPLES: 100, **metrics},
                                           {"name": f"h{node}"},
                                           evaluation=scores if first else None)
        else:
            extra = {"evaluation": scores} if first else {}
            reply = agent.secure_train_reply(record, self.contexts[node], start, trained, 100,
                                             metrics, {"name": f"h{node}"}, **extra)
        return Message(reply, reply_to=msg)

    def send_and_receive(self, messages, *, timeout=None):
        return [self.answer(m) for m in messages]


cfg = RunConfig(secure_aggregation="bound=1.0" if secure else "off", min_nodes=hospitals)
out = Path(tempfile.mkdtemp(prefix="loop-rounds-"))
history = RunHistory(out, cfg.to_flower())
history.set_model(MODEL)
aggregator = compose_aggregator(cfg)
settings = dict(quorum=hospitals, deadline=60.0, cohort_caps={}, cap_policy="clip")
arrays = ArrayRecord({"w": Array(np.zeros(params, np.float32))})
train_config, evaluate_config = wire.train_config(MODEL, 0.0), wire.evaluate_config(MODEL)
grid = Hospitals(hospitals)
wall, cpu = time.perf_counter(), time.process_time()
if hasattr(compose, "compose_loop"):  # issue 42: one loop owns the round
    loop = compose.compose_loop(cfg, aggregator, history, **settings)
    loop.run(grid, initial_arrays=arrays, num_rounds=num_rounds, timeout=60.0,
             train_config=train_config, evaluate_config=evaluate_config)
else:  # before: a Flower strategy stack driven by run_rounds (Flower's start when secure)
    strategy = compose.compose_strategy(cfg, aggregator, history, min_train_nodes=hospitals,
                                        min_evaluate_nodes=hospitals,
                                        min_available_nodes=hospitals, **settings)
    rounds.run_rounds(strategy, grid, initial_arrays=arrays, num_rounds=num_rounds,
                      timeout=60.0, train_config=train_config, evaluate_config=evaluate_config)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
saved = json.loads((out / "history.json").read_text())
assert [r["round"] for r in saved["rounds"]] == list(range(1, num_rounds + 1)), saved["rounds"]
print(json.dumps({"wall": wall, "cpu": cpu, "where": rounds.__file__,
                  "evaluated": sum(1 for r in saved["rounds"] if r.get("evaluate"))}))
'''


def run(tree: Path, args: argparse.Namespace) -> dict:
    """One run of ``tree``'s loop in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(args.hospitals), str(args.params),
                           str(args.rounds), "1" if args.secure else "0"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the earlier checkout's folder")
    p.add_argument("--hospitals", type=int, default=10)
    p.add_argument("--params", type=int, default=1_000_000, help="float32 parameters in the model")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5, help="runs of each checkout, alternating")
    p.add_argument("--secure", action="store_true", help="secure aggregation (bound=1.0)")
    args = p.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": ROOT}
    times: dict[str, list[dict]] = {"before": [], "after": []}
    print(f"{args.hospitals} hospitals, {args.params:,} float32 parameters, {args.rounds} rounds, "
          f"{'secure' if args.secure else 'plain'}; load {os.getloadavg()[0]:.1f}", flush=True)
    for i in range(args.repeats):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for side in order:
            got = run(trees[side], args)
            times[side].append(got)
            print(f"  {side:6s} wall {got['wall']:7.2f} s  cpu {got['cpu']:7.2f} s  "
                  f"(evaluated rounds {got['evaluated']}; {got['where']})", flush=True)
    for key in ("wall", "cpu"):
        before = statistics.median(t[key] for t in times["before"])
        after = statistics.median(t[key] for t in times["after"])
        print(f"median {key}: before {before:.2f} s, after {after:.2f} s, after / before "
              f"{after / before:.3f}")
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
