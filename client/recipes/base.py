"""The recipe interface: everything a hospital's own model brings to fedsplit, written down once.

A recipe is a subclass of `Recipe`. It must give a name, a version and `build_model`; the rest has
defaults that follow the task kind (`protocol.tasks`): its labels (class indices: cross-entropy;
values: mean squared error on standardised targets), its metrics besides ``loss``
(classification: ``accuracy``; regression: ``r2`` and ``rmse``) and its selection metric.
Override what differs:

===========================  ====================================================================
``name``, ``version``        identity (class attributes); hospitals must agree on both
``Params``                   a pydantic model of the recipe's parameters (validated; recorded
                             with the run and in every weight file)
``tasks``                    the task kinds the recipe trains (default: every kind whose labels
                             are class indices or values, e.g. classification, regression)
``build_model(inputs)``      the ``nn.Module``, from what the agreed schema says (`ModelInputs`)
``targets(model, y)``        the training targets as the loss wants them (y may be 2-D, e.g. time
                             and event)
``loss(model, out, target)``  the batch loss (a scalar tensor; need not be a per-row sum)
``metrics(model, x, y, device)``  the metric values on held-out rows (``loss`` among them)
``metric_names(task)``       the metric names `metrics` returns
``selection_metric(task)``   the one metric (higher is better) that picks a baseline's round
``predict(model, x)``        predictions in the target's units (used by ``fedsplit predict``)
``read_data(path)``          optional reader for files that are not tables: a `Dataset`, or None
                             when the path is not for this reader
``read_inputs(path)``        optional: unlabelled inputs and row ids for ``fedsplit predict``
                             (default: `read_data`'s inputs)
``optimizers(model, lr)``    optional: the optimizers a training step uses (default one Adam)
``train_step(...)``          optional: one optimizer step (AMP, gradient clipping, several
                             optimizers); must add ``penalty()`` (FedProx) to what it minimises
``per_sample_loss``          False when the loss is not a sum over rows (a Cox partial
                             likelihood): DP-SGD is then refused with that reason
``federated(model)``         the state_dict entries that travel every round (default: trained
                             parameters and BatchNorm running statistics; never integer counters
                             or frozen parameters); the rest stays at each hospital
``local_batch_norm``         True: FedBN, every BatchNorm layer (weights and statistics) stays
                             at each hospital
``layers(model)``            optional: the model's layers in forward order, for in-site layer
                             split and pipeline training (default: an ``nn.Sequential``'s
                             children; None: the model cannot be cut into stages)
===========================  ====================================================================

`Standardize` (federated feature standardisation as buffers that travel with the weights) is for
recipe models too: a model holding one gets the federation's pooled mean and standard deviation
before round 1 (`Recipe.set_statistics`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from fedsplit.client.recipes.spec import ModelInputs, ModelSpec
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import RecipeIdentity
from fedsplit.protocol.tasks import TaskKind, task_kind
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

if TYPE_CHECKING:
    from fedsplit.client.data import Dataset

METRIC_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")


class NoParams(BaseModel):
    """A recipe without parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Standardize(nn.Module):
    """``(x - mean) / std`` with the statistics stored as buffers (they travel with weights).

    ``shape`` is one row's feature shape for tables, ``(1,)`` for images (one pooled pixel mean).
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("std", torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standardise ``x``; missing values (NaN) become the mean."""
        z = (x - self.mean) / self.std
        return torch.nan_to_num(z, nan=0.0)


def no_penalty() -> torch.Tensor:
    """The penalty of a training step without FedProx."""
    return torch.zeros(())


class Recipe:
    """Base class of every recipe (see the module docstring for what to override)."""

    name: ClassVar[str] = ""
    version: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    tasks: ClassVar[tuple[str, ...]] = ()
    per_sample_loss: ClassVar[bool] = True
    #: FedBN (Li et al., 2021): every BatchNorm layer's weights and running statistics stay at
    #: each hospital and never travel (see `federated`)
    local_batch_norm: ClassVar[bool] = False

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        if isinstance(params, BaseModel):
            params = params.model_dump(mode="json")
        try:
            self.params = self.Params.model_validate(params or {})
        except ValidationError as e:
            raise ConfigError(
                f"Recipe {self.name} version {self.version} refuses its parameters: "
                f"{e.errors(include_url=False)}. Fix --recipe-params. Received: {params}"
            ) from e

    # --- identity -------------------------------------------------------------------------
    @property
    def identity(self) -> RecipeIdentity:
        """Name, version and validated parameters (what hospitals compare)."""
        return RecipeIdentity(name=self.name, version=self.version,
                              params=self.params.model_dump(mode="json"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.identity.to_json()})"

    def model_spec(self, inputs: ModelInputs) -> ModelSpec:
        """The `ModelSpec` (and so the model id) of this recipe's model."""
        self.check_task(inputs.task)
        return ModelSpec(kind="recipe", task=inputs.task, input_shape=tuple(inputs.input_shape),
                         num_outputs=int(inputs.num_outputs), recipe=self.identity,
                         selection=self.selection_metric(inputs.task))

    def check_task(self, task: str) -> None:
        """Refuse a task this recipe does not train (`tasks`; none named: every kind whose labels
        are class indices or values, which the default targets, loss and metrics handle)."""
        kind = task_kind(task)
        if task in self.tasks if self.tasks else (kind.classes or kind.values):
            return
        trains = ", ".join(self.tasks) or "every task whose labels are classes or values"
        raise ConfigError(f"Recipe {self.name} trains {trains}; the hospitals' data is {task}. "
                          f"Choose another recipe or --task. Received: {task!r}")

    # --- model ------------------------------------------------------------------------------
    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """The model for ``inputs`` (required)."""
        raise NotImplementedError(f"Recipe {self.name} must define build_model(inputs)")

    def set_statistics(self, model: nn.Module, mean: np.ndarray, std: np.ndarray,
                       target_mean: float = 0.0, target_std: float = 1.0) -> None:
        """Store the federation's pooled statistics in the model's `Standardize` modules and its
        ``target_mean``/``target_std`` buffers, where it has them (std floored at 1e-6)."""
        safe = np.where(np.asarray(std) > 1e-6, std, 1.0)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, Standardize):
                    module.mean.copy_(torch.as_tensor(mean, dtype=torch.float32)
                                      .reshape(module.mean.shape))
                    module.std.copy_(torch.as_tensor(safe, dtype=torch.float32)
                                     .reshape(module.std.shape))
            buffers = dict(model.named_buffers())
            if "target_mean" in buffers and "target_std" in buffers:
                buffers["target_mean"].fill_(float(target_mean))
                buffers["target_std"].fill_(float(target_std) if target_std > 1e-6 else 1.0)

    def federated(self, model: nn.Module) -> list[str]:
        """The ``state_dict`` entries that travel every round, in ``state_dict`` order.

        Default: every parameter that trains (``requires_grad``) and the running mean and
        variance of every BatchNorm layer. Integer buffers (``num_batches_tracked``), frozen
        parameters and other buffers (`Standardize`'s statistics) never travel: every hospital
        keeps them as the federation's initial model set them (counters count locally). With
        `local_batch_norm`, BatchNorm layers stay home entirely (FedBN). Override to name other
        tensors (e.g. only a head: ``[n for n in model.state_dict() if n.startswith("head.")]``).
        """
        norms = {name for name, m in model.named_modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        trained = {name for name, p in model.named_parameters(remove_duplicate=False)
                   if p.requires_grad}
        out = []
        for name in model.state_dict():
            owner, _, leaf = name.rpartition(".")
            if owner in norms and self.local_batch_norm:
                continue
            if name in trained or (owner in norms and leaf in ("running_mean", "running_var")):
                out.append(name)
        return out

    # --- targets, loss, metrics -------------------------------------------------------------
    def targets(self, model: nn.Module, y: np.ndarray) -> torch.Tensor:
        """Class indices (a kind whose labels are classes), or targets standardised with the
        model's ``target_mean``/``target_std`` buffers when it has them (values, N x 1)."""
        if model_kind(model).classes:
            return torch.as_tensor(np.asarray(y), dtype=torch.long)
        mean, std = _target_scale(model)
        scaled = (np.asarray(y, dtype=np.float32) - mean) / std
        scaled = scaled.reshape(-1, 1) if scaled.ndim == 1 else scaled
        return torch.as_tensor(scaled, dtype=torch.float32)

    def loss(self, model: nn.Module, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy (labels are classes) or mean squared error (values) of one batch."""
        if model_kind(model).classes:
            return nn.functional.cross_entropy(output, target)
        return nn.functional.mse_loss(output, target)

    def metric_names(self, task: str) -> tuple[str, ...]:
        """The names `metrics` returns for ``task``: ``loss`` and the kind's metrics."""
        return ("loss", *task_kind(task).metrics)

    def selection_metric(self, task: str) -> str:
        """The metric (higher is better) that picks a baseline's round: the kind's."""
        return task_kind(task).selection

    def forward_all(self, model: nn.Module, x: np.ndarray, device: torch.device) -> torch.Tensor:
        """The model's outputs for every row of ``x`` (in batches of 4096)."""
        xt = torch.as_tensor(x, dtype=torch.float32)
        outs = [model(xt[i:i + 4096].to(device)) for i in range(0, max(len(xt), 1), 4096)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    @torch.no_grad()
    def metrics(self, model: nn.Module, x: np.ndarray, y: np.ndarray,
                device: torch.device) -> dict[str, float]:
        """``loss`` and the task kind's metrics of the predictions (`protocol.tasks.TaskKind.score`:
        ``accuracy``; ``r2``, ``rmse``; ...)."""
        out = self.forward_all(model, x, device)
        loss = float(self.loss(model, out, self.targets(model, y).to(device)))
        pred = self.predict_outputs(model, out).cpu().numpy()
        return {"loss": loss, **model_kind(model).score(np.asarray(y), pred)}

    def predict_outputs(self, model: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Model outputs -> class indices, or values in target units."""
        if model_kind(model).classes:
            return out.argmax(dim=1)
        mean, std = _target_scale(model)
        return out.squeeze(1) * std + mean

    @torch.no_grad()
    def predict(self, model: nn.Module, x: np.ndarray) -> dict[str, np.ndarray]:
        """Columns of ``fedsplit predict``'s output: ``p_<k>`` per class and ``predicted``
        (labels are classes), or ``predicted`` in target units."""
        model.eval()
        out = self.forward_all(model, x, torch.device("cpu"))
        if model_kind(model).classes:
            probs = torch.softmax(out, dim=1).numpy().astype(np.float64)
            cols = {f"p_{k}": probs[:, k] for k in range(probs.shape[1])}
            return {**cols, "predicted": probs.argmax(axis=1)}
        return {"predicted": self.predict_outputs(model, out).numpy().astype(np.float64)}

    # --- data -------------------------------------------------------------------------------
    def read_data(self, path: Path) -> Dataset | None:
        """A hospital's data that is not a table (images, arrays), or None: not for this reader.

        The `Dataset` holds ``x`` (N x input shape, float32), ``y``, the task and a ``kind``
        (``"mlp"``: per-feature statistics; anything else pools all values, as for images).
        """
        return None

    def read_inputs(self, path: Path) -> tuple[np.ndarray, list[str]] | None:
        """Inputs to score (``fedsplit predict``) with one id per row (e.g. the file name), or
        None: not for this reader. Default: `read_data`'s inputs, rows numbered from 0."""
        data = self.read_data(path)
        if data is None:
            return None
        return np.asarray(data.x, dtype=np.float32), [str(i) for i in range(len(data.x))]

    # --- training ---------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]] | None:
        """The model's layers in forward order, as ``(name, module)`` pairs whose composition is
        the model's ``forward`` (``model(x) == layer_n(... layer_1(x))``): what in-site ``model``
        and ``pipeline`` training (`client.parallel`) cut into stages, and what a device map
        names. Default: an ``nn.Sequential``'s children, named by their index (``0``, ``1``,
        ...); None for any other model (it trains on one device, or with ``data`` replicas).
        Override for a model whose forward is a chain of sub-modules (e.g. ``features`` then
        ``head``); every trained parameter must belong to one layer."""
        if isinstance(model, nn.Sequential):
            return list(model.named_children())
        return None

    def optimizers(self, model: nn.Module, lr: float) -> Sequence[torch.optim.Optimizer]:
        """The optimizers `train_step` uses: one Adam at the run's learning rate."""
        return [torch.optim.Adam(model.parameters(), lr=lr)]

    def train_step(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor,
                   optimizers: Sequence[torch.optim.Optimizer],
                   penalty: Callable[[], torch.Tensor] = no_penalty) -> float:
        """One optimizer step on a batch; returns the batch loss (without the penalty)."""
        for opt in optimizers:
            opt.zero_grad()
        loss = self.loss(model, model(xb), yb)
        (loss + penalty()).backward()
        for opt in optimizers:
            opt.step()
        return float(loss.item())


class ModelView(nn.Module):
    """The model a recipe built, as its code sees it while fedsplit runs it through a wrapper
    (data-parallel replicas, layers on several devices, Opacus's per-sample gradients).

    ``view(x)`` runs the wrapper; everything else is the model's own: its attributes
    (``spec``, custom ones), parameters, buffers, modules and state under their own names. So a
    recipe's `Recipe.train_step`, `Recipe.loss` and `Recipe.optimizers` take the view where they
    take the model, and a step through it is the wrapper's step (its gradient all-reduce, its
    per-sample gradients) on the model's own tensors.
    """

    def __init__(self, runner: nn.Module, model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_model", model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapper's forward."""
        return self._runner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_model"), name)

    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return self._model.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._model.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return self._model.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._model.named_buffers(*args, **kwargs)

    def modules(self) -> Any:  # type: ignore[override]
        return self._model.modules()

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._model.named_modules(*args, **kwargs)

    def children(self) -> Any:  # type: ignore[override]
        return self._model.children()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._model.state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> ModelView:
        self._runner.train(mode)
        self._model.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._runner.zero_grad(set_to_none)


def model_task(model: nn.Module) -> str:
    """The task of a model built by `client.models.build_model`."""
    spec = getattr(model, "spec", None)
    if spec is None:
        raise ConfigError(f"This model was not built by fedsplit's build_model, so its task is "
                          f"unknown. Received: {type(model).__name__}")
    return str(spec.task)


def model_kind(model: nn.Module) -> TaskKind:
    """The task kind (`protocol.tasks`) of a model built by `client.models.build_model`."""
    return task_kind(model_task(model))


def _target_scale(model: nn.Module) -> tuple[float, float]:
    buffers = dict(model.named_buffers())
    if "target_mean" in buffers and "target_std" in buffers:
        return float(buffers["target_mean"]), float(buffers["target_std"])
    return 0.0, 1.0


def check_recipe_class(cls: Any, where: str) -> type[Recipe]:
    """Refuse what is not a usable recipe class, naming what is missing."""
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise ConfigError(f"{where} must be a subclass of fedsplit.client.recipes.Recipe. "
                          f"Received: {cls!r}")
    if not cls.name or not cls.version:
        raise ConfigError(f"{where}: a recipe declares its name and version (class attributes "
                          f"name = '...', version = '...'). Received: name={cls.name!r}, "
                          f"version={cls.version!r}")
    try:
        RecipeIdentity(name=cls.name, version=cls.version)
    except ValidationError as e:
        raise ConfigError(f"{where}: a recipe name is 1-64 letters, digits, '_', '.' or '-' and "
                          f"its version a non-empty string. Received: name={cls.name!r}, "
                          f"version={cls.version!r}") from e
    if cls.build_model is Recipe.build_model:
        raise ConfigError(f"{where}: recipe {cls.name} must define build_model(self, inputs). "
                          f"Received: none")
    return cls
