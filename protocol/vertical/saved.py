"""What a vertical run saves beside its weights, for ``fedsplit vertical predict`` to read back.

- `HeadMeta` (``head.json`` beside the label holder's ``head.npz``, `server.vertical.head`):
  the label ``task``, its ``classes`` (classification) or the target's ``y_mean`` / ``y_std``
  (regression), the ``sites`` in the order the head concatenates their embeddings, the fusion
  ``params``, ``num_outputs`` and the ``seed``.
- `SiteModelMeta` (``site.json`` beside a site's ``branch.npz``, `client.vertical.site`): the
  site's name, its branch (`BranchSpec`), its fitted preprocessing, ID column and run tag.

Both are read with ``load`` (`ConfigError` naming the field when malformed) and written with
``save`` (indented JSON, atomically), with the keys fedsplit has always written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Self

from fedsplit.protocol.atomic import write_json_atomic
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.vertical.config import FusionParams
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Saved(BaseModel):
    """A saved JSON file: read and checked (`load`), written atomically (`save`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    _what: ClassVar[str]

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read ``path``; `ConfigError` when unreadable or malformed."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} is not readable JSON ({e}). Received: {path}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object ({cls._what}). "
                              f"Received: {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            raise ConfigError(f"{path} is not {cls._what}: {where}: {err['msg']}. "
                              f"Train the run again. Received: {path}") from e

    def to_json(self) -> dict[str, Any]:
        """The file's content as JSON-ready data."""
        return self.model_dump(mode="json", by_alias=True)

    def save(self, path: str | Path) -> None:
        """Write to ``path`` atomically (indented JSON)."""
        write_json_atomic(path, self.to_json())


class HeadMeta(_Saved):
    """``head.json``: what predict needs besides the fusion head's weights."""

    _what: ClassVar[str] = "a saved fusion head's metadata (head.json)"

    task: str
    classes: list[str] = Field(default_factory=list)
    y_mean: float = 0.0
    y_std: float = 1.0
    sites: list[str]
    params: FusionParams
    num_outputs: int
    seed: int = 0


class BranchSpec(BaseModel):
    """A site's branch: its input width, embedding width, hidden width, learning rate and seed
    (the keys as the site agent has always written them: ``in-dim``, ``embedding-dim``, ...)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    in_dim: int = Field(alias="in-dim")
    embedding_dim: int = Field(alias="embedding-dim")
    branch_hidden: int = Field(alias="branch-hidden")
    lr: float
    seed: int | None = None


class SiteModelMeta(_Saved):
    """``site.json``: a site's saved branch (`BranchSpec`) and its fitted preprocessing
    (``prep``: `client.vertical.data.Preprocessor.to_dict`)."""

    _what: ClassVar[str] = "a saved vertical site model (site.json)"

    site: str
    branch: BranchSpec
    prep: dict[str, Any]
    id_column: str | None = None
    tag: str | None = None
