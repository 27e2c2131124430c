"""Adam for the default training step, without `torch.optim.Optimizer`'s first-use cost (issue 32).

Every method of `torch.optim.Optimizer` that builds or clears it (``add_param_group``,
``zero_grad``, ``state_dict``) is wrapped by ``torch._disable_dynamo``, which imports
``torch._dynamo`` the first time any optimizer is built in a process: 1.2 s on a quiet 2-core
machine, 4 s under load. Flower starts one ClientApp process per message, so every training
message paid it, more than the hospital's own work in a round (0.09 s).

`Adam` runs the same update as ``torch.optim.Adam`` (defaults: betas 0.9/0.999, eps 1e-8, no
weight decay, no AMSGrad) by calling torch's own functional kernel, ``torch.optim.adam.adam``,
with the state ``torch.optim.Adam`` keeps (a CPU ``step`` tensor, ``exp_avg``, ``exp_avg_sq``
per parameter that has a gradient): the weights are bit-identical step by step
(tests/client/test_optim.py). It serves the default `Recipe.train_step` only (``zero_grad`` and
``step``); a recipe that writes its own ``optimizers`` or ``train_step`` gets real
``torch.optim`` optimizers (learning-rate schedulers, ``GradScaler`` and Opacus need them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from fedsplit.client.recipes.base import Recipe
from torch import nn
from torch.optim.adam import adam

_SCALAR = {False: torch.float32, True: torch.float64}  # torch.optim's _get_scalar_dtype


class Adam:
    """``torch.optim.Adam(params, lr)`` for `Recipe.train_step`: ``zero_grad()`` and ``step()``."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("Adam got an empty parameter list (the model has no parameters "
                             "to train). Received: 0 parameters")
        self.lr, self.betas, self.eps = float(lr), betas, eps
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients, as ``torch.optim.Optimizer.zero_grad`` does."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One Adam update of every parameter that has a gradient."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in self.params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients; write the recipe's "
                                   "own optimizers (e.g. torch.optim.SparseAdam)")
            state = self.state.get(p)
            if state is None:
                state = self.state[p] = {
                    "step": torch.tensor(0.0, dtype=_SCALAR[torch.get_default_dtype() == torch.float64]),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            adam(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                 has_complex=any(torch.is_complex(p) for p in params),
                 amsgrad=False, beta1=self.betas[0], beta2=self.betas[1], lr=self.lr,
                 weight_decay=0.0, eps=self.eps, maximize=False)


def training_optimizers(recipe: Recipe, model: nn.Module, lr: float) -> list[Any]:
    """The optimizers `client.train.fit` steps: the recipe's own when it writes ``optimizers`` or
    ``train_step``; else the default one Adam, as this module's `Adam` (same steps)."""
    if _own(recipe, "optimizers") or _own(recipe, "train_step"):
        return list(recipe.optimizers(model, lr))
    return [Adam(model.parameters(), lr=lr)]


def _own(recipe: Recipe, method: str) -> bool:
    return getattr(type(recipe), method) is not getattr(Recipe, method)
