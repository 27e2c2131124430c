"""Synthetic Flower run folders in the exact layout the coordinator writes (server/history.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.protocol import Update, write_weights

HOSTILE = '<script>alert("x")</script>&site'


def _report(strategy: str, sites: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    base = {"num_examples": 0, "weight": 0.0, "excluded": False, "reason": None,
            "claimed_examples": None, "flags": [], "trimmed_fraction": None, "trimmed_most": False,
            "selected": None, "score": None, "l2_to_aggregate": None}
    full = [{**base, **s} for s in sites]
    return {"strategy": strategy, "params": params, "num_examples": sum(s["num_examples"] for s in full),
            "sites": full, "memory_budget": None, "working_bytes": None}


def _train_site(name: str, n: int, loss: float, eps: float | None = None) -> dict[str, Any]:
    metrics: dict[str, float] = {"num-examples": float(n), "train-loss": loss}
    if eps is not None:
        metrics["epsilon"] = eps
    return {"site": name, "num_examples": n, "metrics": metrics, "info": {"device": "cpu"}}


def write_hostile_run(out: Path, *, rounds: int = 2, with_models: bool = True) -> Path:
    """A krum run with every status: selected, not selected, excluded, late, failed, capped.

    ``out`` gets ``federation/history.json`` (+ models) and ``summary.json``; returns the run folder.
    """
    fed = out / "federation"
    (fed / "models").mkdir(parents=True, exist_ok=True)
    history: dict[str, Any] = {
        "status": "finished",
        "config": {"num-server-rounds": rounds, "strategy": "krum", "strategy-params": '{"f": 1}',
                   "dp": "epsilon=2.0,delta=1e-5"},
        "model_id": "mlp/classification/4/2/8", "started_at": 1_700_000_000.0,
        "finished_at": 1_700_000_100.0, "rounds": [],
    }
    for number in range(1, rounds + 1):
        train = [
            _train_site("hospital-a", 100, 0.5 / number, eps=0.4 * number),
            _train_site("hospital-b", 90, 0.6 / number, eps=0.5 * number),
            _train_site(HOSTILE, 80, 0.7 / number, eps=0.3 * number),
            {"site": "hospital-c", "excluded": True,
             "reason": "Parameter 'w' in the update holds 3 NaN/Inf value(s)"},
            {"site": "hospital-d", "excluded": True, "late": True,
             "reason": "no train reply within round-timeout (30 s)"},
            {"site": "hospital-e", "excluded": True,
             "reason": "the site's ClientApp failed: RuntimeError: CUDA out of memory"},
        ]
        report = _report("krum", [
            {"site": "hospital-a", "num_examples": 100, "weight": 1.0, "selected": True, "score": 1.5,
             "l2_to_aggregate": 0.0},
            {"site": "hospital-b", "num_examples": 90, "weight": 0.0, "selected": False, "score": 9.0,
             "l2_to_aggregate": 2.5},
            {"site": HOSTILE, "num_examples": 50, "claimed_examples": 80, "weight": 0.0,
             "selected": False, "score": 7.0, "l2_to_aggregate": 1.25},
            {"site": "hospital-c", "num_examples": 0, "excluded": True,
             "reason": "Parameter 'w' in the update holds 3 NaN/Inf value(s)"},
        ], {"f": 1})
        evaluate = {"sites": [
            {"site": name, "num_examples": 20,
             "metrics": {"num-examples": 20.0, "accuracy": acc + 0.05 * number}}
            for name, acc in (("hospital-a", 0.8), ("hospital-b", 0.7))
        ], "metrics": {"accuracy": 0.75 + 0.05 * number, "loss": 0.5 / number}}
        entry = {"round": number, "train": {"sites": train, "metrics": {"train-loss": 0.5 / number}},
                 "aggregation": report, "model": f"models/round-{number:03d}.h5", "train_seconds": 1.0,
                 "evaluate": evaluate, "seconds": 1.5}
        history["rounds"].append(entry)
        if with_models:
            write_weights(Update(arrays={"w": np.full((2, 2), number, np.float32)}, num_examples=100,
                                 round=number), fed / "models" / f"round-{number:03d}.h5")
            (fed / "models" / f"round-{number:03d}.report.json").write_text(json.dumps(report))
    history["rounds"].append({"round": rounds + 1, "train": {"sites": [], "metrics": {}},
                              "error": "only 1 valid training replies, fewer than the quorum of 3; "
                                       "global model unchanged", "seconds": 0.2})
    (fed / "history.json").write_text(json.dumps(history))
    summary = {"task": "classification", "centralized": {"metrics": {"accuracy": 0.95}},
               "local_only": [{"site": "hospital-a", "metrics": {"accuracy": 0.7}},
                              {"site": "hospital-b", "metrics": {"accuracy": 0.65}}],
               "rounds": [{"round": n, "metrics": {"accuracy": 0.7 + 0.1 * n}} for n in range(1, rounds + 1)]}
    (out / "summary.json").write_text(json.dumps(summary))
    return fed
