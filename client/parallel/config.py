"""What a site asks for when it splits its own training: the mode and its options.

A configuration is written as one string so it travels on the command line (``--parallel``)
and in Flower's run config unchanged::

    none
    data:replicas=2
    model:map=norm+body.0-2/body.3-6
    pipeline:stages=2,microbatches=4
    pipeline:microbatches=8,map=norm+body.0-2/body.3-6,devices=cuda:0+cuda:1

Options: ``replicas`` (data), ``stages`` / ``map`` / ``devices`` (model, pipeline),
``microbatches`` (pipeline), ``timeout`` (seconds, every mode that starts processes) and
``start`` (process start method: ``auto``, ``fork`` or ``spawn``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fedsplit.protocol.errors import ConfigError

MODES = ("none", "data", "model", "pipeline")
START_METHODS = ("auto", "fork", "spawn")
_INT_OPTIONS = {"replicas", "stages", "microbatches"}
_KEYS = {
    "none": set(),
    "data": {"replicas", "devices", "timeout", "start"},
    "model": {"stages", "map", "devices"},
    "pipeline": {"stages", "microbatches", "map", "devices", "timeout", "start"},
}


@dataclass(frozen=True)
class ParallelConfig:
    """How one site splits its local training.

    Parameters
    ----------
    mode : str
        ``none`` (one device), ``data`` (replicas, gradients all-reduced every step),
        ``model`` (layers across devices, one process) or ``pipeline`` (GPipe over processes).
    replicas : int (default: 2)
        Data-parallel replicas (processes); each batch is split in this many shards.
    stages : int (default: 2)
        Model/pipeline stages when no ``device_map`` is given.
    microbatches : int (default: 4)
        Pipeline micro-batches per batch.
    device_map : str | None (default: None)
        Layers of each stage, stages separated by ``/``, layers by ``+``, ranges as
        ``body.0-2`` (see `client.parallel.device_map`); None picks a balanced split.
    devices : str (default: "auto")
        ``auto`` (``cuda:i`` for stage/replica ``i`` when enough GPUs, else ``cpu``) or a ``+``
        separated list, one device per stage or replica (e.g. ``cuda:0+cuda:1``).
    timeout_s : float (default: 3600.0)
        Upper bound on a multi-process run, and on every collective inside it.
    start_method : str (default: "auto")
        ``fork`` (fast, CPU only), ``spawn`` (always safe, needed for CUDA) or ``auto``.
    """

    mode: str = "none"
    replicas: int = 2
    stages: int = 2
    microbatches: int = 4
    device_map: str | None = None
    devices: str = "auto"
    timeout_s: float = 3600.0
    start_method: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                f"Parallel mode must be one of {', '.join(MODES)} (e.g. 'data:replicas=2'). "
                f"Received: {self.mode!r}"
            )
        for name in ("replicas", "stages", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ConfigError(f"Parallel option {name} must be an integer from 1 to 64. "
                                  f"Received: {value!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"Parallel option timeout must be a positive number of seconds. "
                              f"Received: {self.timeout_s!r}")
        if self.start_method not in START_METHODS:
            raise ConfigError(f"Parallel option start must be one of {', '.join(START_METHODS)}. "
                              f"Received: {self.start_method!r}")

    @property
    def workers(self) -> int:
        """Devices (or processes) the mode uses, before a device map is applied."""
        return {"none": 1, "data": self.replicas}.get(self.mode, self.stages)

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Parse ``MODE[:key=value,...]`` (see the module docstring)."""
        mode, _, rest = text.strip().partition(":")
        mode = mode.strip()
        if mode not in MODES:
            cls(mode=mode)  # raises the ConfigError naming the modes
        values: dict[str, object] = {"mode": mode}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = pair.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key not in _KEYS[mode]:
                allowed = ", ".join(sorted(_KEYS[mode])) or "none"
                raise ConfigError(
                    f"Parallel mode {mode!r} takes options key=value with keys: {allowed}. "
                    f"Received: {pair!r}"
                )
            if key in _INT_OPTIONS:
                try:
                    values[key] = int(value)
                except ValueError:
                    raise ConfigError(f"Parallel option {key} must be an integer. "
                                      f"Received: {value!r}") from None
            elif key == "timeout":
                try:
                    values["timeout_s"] = float(value)
                except ValueError:
                    raise ConfigError(f"Parallel option timeout must be seconds. "
                                      f"Received: {value!r}") from None
            elif key == "map":
                values["device_map"] = value
            elif key == "start":
                values["start_method"] = value
            else:
                values[key] = value
        return cls(**values)  # type: ignore[arg-type]

    def to_string(self) -> str:
        """Inverse of `parse`: only the options that differ from the defaults."""
        names = {"timeout_s": "timeout", "start_method": "start", "device_map": "map"}
        parts = []
        for f in fields(self):
            if f.name == "mode":
                continue
            key = names.get(f.name, f.name)
            value = getattr(self, f.name)
            if key in _KEYS[self.mode] and value != f.default:
                parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
        return self.mode + (":" + ",".join(parts) if parts else "")


def as_config(parallel: str | ParallelConfig) -> ParallelConfig:
    """Accept a config or its string form."""
    if isinstance(parallel, ParallelConfig):
        return parallel
    if not isinstance(parallel, str):
        raise ConfigError(f"parallel must be a string like 'data:replicas=2' or a ParallelConfig. "
                          f"Received: {parallel!r}")
    return ParallelConfig.parse(parallel)
