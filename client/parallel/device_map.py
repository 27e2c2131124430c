"""Device maps: which consecutive layers of a model run on which stage (device).

A model's layers, in forward order, are what its recipe's `Recipe.layers` says (docs/recipes.md):
for the built-in MLP and CNN ``norm`` (the input standardisation) and the body's children
``body.0`` ... ``body.N``; for a recipe's ``nn.Sequential`` its children ``0`` ... ``N``; for
another recipe model the layers its ``layers`` hook names. For the seed's CNN::

    norm  body.0 Conv2d  body.1 ReLU  body.2 MaxPool  body.3 Flatten  body.4 Linear 128
          body.5 ReLU    body.6 Linear classes

A map lists each stage's layers: stages are separated by ``/``, layers by ``+``, and
``body.0-2`` stands for ``body.0+body.1+body.2`` (``0-2`` for ``0+1+2``).
``norm+body.0-2/body.3-6`` puts the convolution and pooling on stage 0 and flatten and the
dense layers on stage 1. Stages must cover every layer exactly once, in forward order, and none
may be empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from fedsplit.client.models import recipe_of
from fedsplit.protocol.errors import ConfigError
from torch import nn

_RANGE = re.compile(r"^(?P<prefix>(?:[A-Za-z_]\w*\.)*)(?P<lo>\d+)-(?P<hi>\d+)$")
_NUMBERED = re.compile(r"^(?P<prefix>(?:[A-Za-z_]\w*\.)*)(?P<index>\d+)$")


def model_layers(model: nn.Module, mode: str = "model") -> list[tuple[str, nn.Module]]:
    """The model's layers in forward order (its recipe's `Recipe.layers`); a model its recipe
    cannot cut into stages is refused, naming the recipe, the mode and the fix."""
    recipe = recipe_of(model)
    layers = recipe.layers(model)
    if not layers:
        raise ConfigError(
            f"In-site {mode} parallelism cuts a model into stages of consecutive layers, but "
            f"recipe {recipe.identity.label()} builds a {type(model).__name__} that is not an "
            f"nn.Sequential and its recipe names no layers. Build the model as an nn.Sequential, "
            f"or give the recipe a layers(model) method returning [(name, module), ...] in forward "
            f"order (docs/recipes.md); or use parallel=data:replicas=R (any model) or none. "
            f"Received: recipe {recipe.identity.label()}, parallel mode {mode!r}"
        )
    names = [name for name, _ in layers]
    if len(set(names)) != len(names) or any(not n or "/" in n or "+" in n for n in names):
        raise ConfigError(f"Recipe {recipe.identity.label()}'s layers(model) must give each layer a "
                          f"distinct, non-empty name without '/' or '+'. Received: {names}")
    return [(str(name), module) for name, module in layers]


def layer_names(model: nn.Module) -> list[str]:
    """The model's layers in forward order (built-ins: ``norm``, ``body.0``, ..., ``body.N``)."""
    return [name for name, _ in model_layers(model)]


def layer_module(model: nn.Module, name: str) -> nn.Module:
    """The module behind a layer name from `layer_names`."""
    return dict(model_layers(model))[name]


@dataclass(frozen=True)
class DeviceMap:
    """The layers of each stage, in forward order (validated against a model by `resolve`)."""

    stages: tuple[tuple[str, ...], ...]

    def __len__(self) -> int:
        return len(self.stages)

    def to_string(self) -> str:
        """The compact form, e.g. ``norm+body.0-2/body.3-6``."""
        return "/".join("+".join(_compress(stage)) for stage in self.stages)

    def build(self, model: nn.Module) -> list[nn.Sequential]:
        """One `nn.Sequential` per stage, sharing (not copying) the model's modules."""
        layers = dict(model_layers(model))
        return [nn.Sequential(*(layers[n] for n in stage)) for stage in self.stages]

    def owner(self) -> dict[str, int]:
        """Layer name -> stage index."""
        return {name: i for i, stage in enumerate(self.stages) for name in stage}


def _compress(names: tuple[str, ...]) -> list[str]:
    """Runs of consecutive numbered layers as ranges: ``body.0+body.1+body.2`` -> ``body.0-2``."""
    out: list[str] = []
    run: list[int] = []
    prefix = ""

    def flush() -> None:
        if run:
            out.append(f"{prefix}{run[0]}" if len(run) == 1 else f"{prefix}{run[0]}-{run[-1]}")
            run.clear()

    for name in names:
        match = _NUMBERED.match(name)
        if match and run and match["prefix"] == prefix and int(match["index"]) == run[-1] + 1:
            run.append(int(match["index"]))
            continue
        flush()
        if match:
            prefix = match["prefix"]
            run.append(int(match["index"]))
        else:
            out.append(name)
    flush()
    return out


def _expand(token: str, known: list[str], text: str) -> list[str]:
    match = _RANGE.match(token)
    if match:
        lo, hi = int(match["lo"]), int(match["hi"])
        names = [f"{match['prefix']}{i}" for i in range(lo, hi + 1)]
        if lo > hi or not names:
            raise ConfigError(f"Layer range {token!r} must go from low to high (e.g. body.0-2). "
                              f"Received: {text!r}")
    else:
        names = [token]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"Unknown layer {unknown[0]!r} in the device map; this model's layers are "
            f"{', '.join(known)}. Received: {text!r}"
        )
    return names


def parse_device_map(text: str | dict[str, int], model: nn.Module) -> DeviceMap:
    """Parse and validate a map against ``model``.

    ``text`` is the string form (``norm+body.0-2/body.3-6``) or a dict ``{layer: stage}``.
    Refused with a `ConfigError`: unknown layers, empty stages, layers missing, repeated or out
    of forward order, and more stages than layers.
    """
    known = layer_names(model)
    shown = text if isinstance(text, str) else dict(text)
    if isinstance(text, dict):
        unknown = [k for k in text if k not in known]
        if unknown:
            raise ConfigError(
                f"Unknown layer {unknown[0]!r} in the device map; this model's layers are "
                f"{', '.join(known)}. Received: {shown!r}"
            )
        bad = [v for v in text.values() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
        if bad:
            raise ConfigError(f"Device map values are stage indices 0, 1, ... "
                              f"Received: {shown!r}")
        count = max(text.values(), default=-1) + 1
        stages = [[n for n in known if text.get(n) == i] for i in range(count)]
    else:
        if not text.strip():
            raise ConfigError("A device map needs at least one stage, e.g. 'norm+body.0-2/body.3-6'. "
                              f"Received: {shown!r}")
        parts = text.split("/")
        if len(parts) > len(known):
            raise ConfigError(
                f"The device map has {len(parts)} stages but the model has only {len(known)} "
                f"layers ({', '.join(known)}); use at most {len(known)} stages. Received: {shown!r}"
            )
        stages = []
        for part in parts:
            tokens = [t.strip() for t in part.split("+") if t.strip()]
            stages.append([n for t in tokens for n in _expand(t, known, text)])
    if len(stages) > len(known):
        raise ConfigError(
            f"The device map has {len(stages)} stages but the model has only {len(known)} layers "
            f"({', '.join(known)}); use at most {len(known)} stages. Received: {shown!r}"
        )
    empty = [i for i, s in enumerate(stages) if not s]
    if empty:
        raise ConfigError(
            f"Stage {empty[0]} of the device map is empty; every stage needs at least one layer "
            f"(stages are separated by '/'). Received: {shown!r}"
        )
    placed = [n for s in stages for n in s]
    repeated = sorted({n for n in placed if placed.count(n) > 1}, key=known.index)
    if repeated:
        raise ConfigError(f"Layer {repeated[0]!r} is placed on more than one stage; place each layer "
                          f"once. Received: {shown!r}")
    missing = [n for n in known if n not in placed]
    if missing:
        raise ConfigError(
            f"The device map leaves out layer(s) {', '.join(missing)}; every layer must be placed. "
            f"Received: {shown!r}"
        )
    if placed != known:
        raise ConfigError(
            f"Stages must hold consecutive layers in forward order ({' -> '.join(known)}). "
            f"Received: {shown!r}"
        )
    return DeviceMap(tuple(tuple(s) for s in stages))


def default_device_map(model: nn.Module, stages: int) -> DeviceMap:
    """A balanced map into ``stages`` stages.

    Layers are grouped in blocks that start at each layer with weights or at ``Flatten`` (the
    activation and pooling that follow stay with them); blocks are shared out evenly, later
    stages taking the extra ones. For the seed's CNN and 2 stages this is convolution and
    pooling on stage 0, flatten and dense layers on stage 1. With more stages than blocks,
    single layers are shared out instead.
    """
    layers = dict(model_layers(model))
    known = list(layers)
    if stages > len(known):
        raise ConfigError(
            f"Cannot split a model of {len(known)} layers ({', '.join(known)}) into {stages} "
            f"stages; use at most {len(known)}. Received: stages={stages}"
        )
    blocks: list[list[str]] = []
    for name in known:
        module = layers[name]
        starts = any(True for _ in module.parameters()) or isinstance(module, nn.Flatten)
        if not blocks or (starts and any(
            any(True for _ in layers[n].parameters()) for n in blocks[-1]
        )):
            blocks.append([name])
        else:
            blocks[-1].append(name)
    units = blocks if stages <= len(blocks) else [[n] for n in known]
    sizes = [len(chunk) for chunk in np.array_split(np.arange(len(units)), stages)][::-1]
    out, start = [], 0
    for size in sizes:
        out.append(tuple(n for unit in units[start : start + size] for n in unit))
        start += size
    return DeviceMap(tuple(out))


def resolve_device_map(model: nn.Module, device_map: str | dict[str, int] | None,
                       stages: int) -> DeviceMap:
    """The map to use: ``device_map`` when given (its stage count wins), else the default."""
    if device_map is None:
        return default_device_map(model, stages)
    return parse_device_map(device_map, model)


def resolve_devices(spec: str, count: int, *, distinct_cuda: bool) -> list[torch.device]:
    """One device per stage or replica.

    ``auto``: ``cuda:0 .. cuda:count-1`` when that many GPUs are visible, ``cpu`` for all when
    there is no GPU. Otherwise a ``+`` separated list of ``count`` devices. Processes that talk
    over NCCL need distinct GPUs (``distinct_cuda``).
    """
    if spec == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus >= count:
            return [torch.device(f"cuda:{i}") for i in range(count)]
        if gpus == 0:
            return [torch.device("cpu")] * count
        raise ConfigError(
            f"{count} stages/replicas need {count} GPUs but {gpus} are visible; pass devices "
            f"explicitly (e.g. devices=cuda:0+cuda:0 or cpu+cpu) or use fewer. Received: devices=auto"
        )
    try:
        devices = [torch.device(d.strip()) for d in spec.split("+")]
    except RuntimeError as e:
        raise ConfigError(f"Devices must be like cpu or cuda:0, separated by '+'. ({e}) "
                          f"Received: {spec!r}") from None
    if len(devices) != count:
        raise ConfigError(f"Give one device per stage/replica ({count}), separated by '+'. "
                          f"Received: {spec!r}")
    kinds = {d.type for d in devices}
    if not kinds <= {"cpu", "cuda"} or len(kinds) > 1:
        raise ConfigError(f"Devices must be all cpu or all cuda. Received: {spec!r}")
    if "cuda" in kinds:
        if not torch.cuda.is_available():
            raise ConfigError(f"CUDA devices were requested but CUDA is not available. "
                              f"Received: {spec!r}")
        devices = [torch.device("cuda", d.index or 0) for d in devices]
        if any(d.index >= torch.cuda.device_count() for d in devices):
            raise ConfigError(f"Only {torch.cuda.device_count()} GPU(s) are visible. "
                              f"Received: {spec!r}")
        if distinct_cuda and len(set(devices)) != len(devices):
            raise ConfigError(f"Processes that exchange tensors over NCCL need one GPU each. "
                              f"Received: {spec!r}")
    return devices
