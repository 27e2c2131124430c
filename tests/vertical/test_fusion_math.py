"""Split training (embeddings up, gradients down) equals joint training in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedsplit.aggregation import get_strategy, strategy_names
from fedsplit.aggregation.errors import IncompatibleUpdatesError, UnknownStrategyError
from fedsplit.client.vertical.model import Branch, build_branch
from fedsplit.protocol.errors import ConfigError, ReplyError
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.server.vertical.head import FusionHead


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_split_training_reaches_the_joint_models_parameters(task: str, rng: np.random.Generator) -> None:
    widths, emb, lr, steps = (5, 3, 7), 4, 0.05, 15
    xs = [rng.normal(size=(96, w)).astype(np.float32) for w in widths]
    y = rng.integers(0, 3, 96) if task == "classification" else rng.normal(size=96)
    outputs = 3 if task == "classification" else 1

    # split: each site owns its branch, the label holder owns the head; only arrays cross
    branches = [Branch(build_branch(w, emb, 6, seed=10 + k), lr) for k, w in enumerate(widths)]
    head = FusionHead([emb] * 3, outputs, task, hidden=8, lr=lr, seed=0)
    # joint: the same modules (same initial values) trained with autograd end to end
    joint_branches = [build_branch(w, emb, 6, seed=10 + k) for k, w in enumerate(widths)]
    joint_head = FusionHead([emb] * 3, outputs, task, hidden=8, lr=lr, seed=0).module
    params = [p for m in [*joint_branches, joint_head] for p in m.parameters()]
    joint_opt = torch.optim.Adam(params, lr=lr)

    for _ in range(steps):
        idx = rng.choice(96, 32, replace=False)
        embeddings = [b.embed(x[idx]) for b, x in zip(branches, xs, strict=True)]
        _, grads = head.step(embeddings, y[idx])
        for b, x, g in zip(branches, xs, grads, strict=True):
            b.backward(x[idx], g)

        joint_opt.zero_grad()
        fused = torch.cat([m(torch.from_numpy(x[idx])) for m, x in zip(joint_branches, xs, strict=True)], 1)
        fused.retain_grad()
        out = joint_head(fused)
        target = torch.from_numpy(y[idx])
        loss = (torch.nn.functional.cross_entropy(out, target) if task == "classification"
                else torch.nn.functional.mse_loss(out.squeeze(1), target.float()))
        loss.backward()
        joint_opt.step()
        # the gradient slices sent to the sites are autograd's dL/de_k of the joint model
        np.testing.assert_allclose(np.concatenate(grads, 1), fused.grad.numpy(), rtol=1e-4, atol=1e-7)

    for split_m, joint_m in [*zip([b.module for b in branches], joint_branches, strict=True),
                             (head.module, joint_head)]:
        for (name, a), (_, b) in zip(split_m.state_dict().items(), joint_m.state_dict().items(), strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    # and training moved them (the comparison is not between untouched initial values)
    fresh = build_branch(widths[0], emb, 6, seed=10)
    assert not torch.allclose(fresh[0].weight, branches[0].module[0].weight)


def test_branch_state_round_trips_with_adam_moments(rng: np.random.Generator) -> None:
    x = rng.normal(size=(8, 4)).astype(np.float32)
    g = rng.normal(size=(8, 3)).astype(np.float32)
    a = Branch(build_branch(4, 3, 0, seed=1), 0.1)
    a.backward(x, g)
    b = Branch(build_branch(4, 3, 0, seed=99), 0.1)
    b.load_state(a.state())
    a.backward(x, g)
    b.backward(x, g)
    np.testing.assert_allclose(a.embed(x), b.embed(x), rtol=1e-6)


def test_no_vertical_strategy_in_the_registry() -> None:
    """Vertical fusion exchanges embeddings, not weights: nothing registered that cannot aggregate."""
    assert not any("vertical" in name for name in strategy_names())
    with pytest.raises(UnknownStrategyError):
        get_strategy("vertical-fusion")


def test_fusion_params_are_validated() -> None:
    assert FusionParams.parse({"fill": "mean", "batch_size": "32"}).batch_size == 32
    with pytest.raises(ConfigError, match=r"fill.*Received: \{'fill': 'nearby'\}"):
        FusionParams.parse({"fill": "nearby"})
    with pytest.raises(ConfigError, match="Known: embedding_dim"):
        FusionParams.parse({"embeding_dim": 8})


def test_head_refuses_embeddings_of_the_wrong_width() -> None:
    head = FusionHead([4, 3], 2, "classification", hidden=0, lr=0.01, seed=0)
    with pytest.raises(ReplyError, match=r"agreed width \[4, 3\]"):
        head.outputs([np.zeros((5, 4), np.float32), np.zeros((5, 2), np.float32)])


def test_fedavg_refuses_different_shapes_and_points_to_vertical_simulate() -> None:
    from fedsplit.aggregation import aggregate_updates
    from fedsplit.protocol.update import Update

    a = Update(arrays={"w": np.zeros((10, 4), np.float32)}, num_examples=5)
    b = Update(arrays={"w": np.zeros((5, 4), np.float32)}, num_examples=5)
    with pytest.raises(IncompatibleUpdatesError, match="fedsplit vertical simulate"):
        aggregate_updates(get_strategy("fedavg"), [a, b])
