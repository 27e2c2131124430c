"""The one registry of aggregation strategies, shared by the Flower and REST paths."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.errors import StrategyParamsError, UnknownStrategyError
from pydantic import ValidationError

_REGISTRY: dict[str, type[AggregationStrategy]] = {}

S = TypeVar("S", bound=type[AggregationStrategy])


def register(cls: S) -> S:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"Strategy name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


@dataclass(frozen=True)
class ParamInfo:
    """One documented strategy parameter."""

    name: str
    type: str
    default: Any
    description: str


@dataclass(frozen=True)
class StrategyInfo:
    """A registered strategy and its parameters."""

    name: str
    summary: str
    params: tuple[ParamInfo, ...]


def strategy_names() -> list[str]:
    """Return the registered names, sorted."""
    return sorted(_REGISTRY)


def describe_strategies() -> list[StrategyInfo]:
    """Return every registered strategy with its documented parameters."""
    infos = []
    for name in strategy_names():
        cls = _REGISTRY[name]
        params = tuple(
            ParamInfo(
                name=pname,
                type=getattr(f.annotation, "__name__", str(f.annotation)),
                default=f.default,
                description=f.description or "",
            )
            for pname, f in cls.Params.model_fields.items()
        )
        infos.append(StrategyInfo(name=name, summary=cls.summary, params=params))
    return infos


def get_strategy(name: str, params: Mapping[str, Any] | None = None) -> AggregationStrategy:
    """Return the strategy registered as ``name``, configured with ``params``.

    Values may be strings (from ``--param key=value``); they are converted to the declared
    types and range-checked. Unknown names and bad values raise errors that list what is valid.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownStrategyError(
            f"No aggregation strategy is called {name!r}. Available: "
            f"{', '.join(strategy_names())} (see `fedsplit strategies`). Received: {name!r}"
        ) from None
    try:
        parsed = cls.Params.model_validate(dict(params or {}))
    except ValidationError as e:
        known = ", ".join(cls.Params.model_fields) or "none"
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
            for err in e.errors()
        )
        raise StrategyParamsError(
            f"Invalid parameters for strategy {name!r}: {problems}. Parameters it takes: {known}. "
            f"Received: {dict(params or {})}"
        ) from e
    return cls(parsed)


def parse_param_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """Parse ``["beta=0.2", "weighted=true"]`` into a dict (values stay strings)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise StrategyParamsError(
                f"Strategy parameters are given as key=value (e.g. --param beta=0.2). "
                f"Received: {pair!r}"
            )
        out[key.strip()] = value.strip()
    return out
