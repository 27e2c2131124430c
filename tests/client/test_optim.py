"""`client.optim.Adam` steps exactly like ``torch.optim.Adam`` and never imports torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from fedsplit.client.optim import Adam
from torch import nn


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model[0].bias.requires_grad_(False)  # a frozen tensor gets no gradient and no state
    return model


def _train(model: nn.Module, opt: object, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("lr", [0.01, 0.3])
def test_bit_identical_to_torch_adam(lr: float) -> None:
    ours, theirs = _model(3), _model(3)
    a = _train(ours, Adam([p for p in ours.parameters() if p.requires_grad], lr=lr), 25)
    b = _train(theirs, torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad],
                                        lr=lr), 25)
    assert a == b
    for (name, p), q in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(ours[3].weight, _model(3)[3].weight)  # it did train


def test_zero_grad_and_skipped_parameters() -> None:
    model = _model(1)
    opt = Adam(model.parameters(), lr=0.1)
    frozen = model[0].bias.detach().clone()
    _train(model, opt, 3)
    assert torch.equal(model[0].bias, frozen)  # no gradient: untouched, no state kept
    assert model[0].bias not in opt.state
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="empty parameter list"):
        Adam([], lr=0.1)


@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_no_dynamo_import() -> None:
    """The point of the class: a fresh process that trains with it never imports torch._dynamo
    (torch.optim.Adam does, 1-4 s per ClientApp process)."""
    code = ("import sys, torch\n"
            "from fedsplit.client.optim import Adam\n"
            "m = torch.nn.Linear(3, 1); o = Adam(m.parameters(), lr=0.1)\n"
            "o.zero_grad(); m(torch.ones(2, 3)).sum().backward(); o.step(); o.zero_grad()\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
            "torch.optim.Adam(m.parameters())\n"
            "assert 'torch._dynamo' in sys.modules  # the check can fail\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_fit_uses_it_only_for_the_default_step() -> None:
    """`client.train.fit` on a built-in model trains exactly as before (torch.optim.Adam) without
    importing torch._dynamo; a recipe with its own train_step still gets torch.optim optimizers."""
    code = (
        "import sys, numpy as np, torch\n"
        "from fedsplit.client.models import ModelSpec, build_model\n"
        "from fedsplit.client.optim import training_optimizers\n"
        "from fedsplit.client.train import fit\n"
        "spec = ModelSpec(kind='mlp', task='classification', input_shape=(5,), num_outputs=2,"
        " hidden=(8,), norm='batch')\n"
        "x = np.random.default_rng(0).normal(size=(40, 5)).astype('float32')\n"
        "y = (x[:, 0] > 0).astype('int64')\n"
        "model = build_model(spec, seed=1)\n"
        "fit(model, x, y, epochs=2, lr=0.05, batch_size=8, seed=3)\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
        "from fedsplit.client.models import recipe_of\n"
        "ref = build_model(spec, seed=1); rec = type(recipe_of(ref))\n"
        "class Own(rec):\n"
        "    def train_step(self, *a, **k): return rec.train_step(self, *a, **k)\n"
        "opts = training_optimizers(Own(), ref, 0.05)\n"
        "assert isinstance(opts[0], torch.optim.Adam), opts\n"
        "rec.optimizers = lambda self, m, lr: [torch.optim.Adam(m.parameters(), lr=lr)]\n"
        "fit(ref, x, y, epochs=2, lr=0.05, batch_size=8, seed=3)\n"
        "for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):\n"
        "    assert torch.equal(a, b), k\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
