"""What the coordinator asks the upload sandbox, and the typed answer it gets back.

The request and the answer cross a process boundary as JSON (zygote pipe, result file); they
are turned into these frozen dataclasses on both sides, once, by `to_json`/`from_json`. The
model layout travels as `ArraySpec` dicts (`ArraySpec.to_dict`/`from_dict`) and is an
`ArraySpec` tuple everywhere else. An answer is either `Parsed` (the file was accepted and its
canonical copy written) or `Refused` (``reason`` is the machine-readable code of the refusal,
``message`` says what was wrong and how to fix it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.errors import FedsplitError
from fedsplit.protocol.keras_layout import KerasLayout


@dataclass(frozen=True)
class InspectRequest:
    """What the coordinator tells the worker about one upload."""

    max_elements: int
    max_total_elements: int
    #: the values' size the file may declare in total, decompressed: the round's model's size,
    #: or the server's cap for a round's first upload (--max-model-mb)
    max_total_bytes: int
    #: where that cap comes from, for the refusal's text
    cap_source: str
    max_depth: int
    expected: tuple[ArraySpec, ...] | None
    num_examples: int | None
    require_count: bool
    site: str | None
    round: int | None
    memory_mb: int
    cpu_s: int
    max_output_bytes: int

    def to_json(self) -> dict[str, Any]:
        """JSON-friendly form (the specs as `ArraySpec.to_dict`)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.expected is not None:
            data["expected"] = [s.to_dict() for s in self.expected]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InspectRequest:
        """Inverse of `to_json`."""
        expected = data.get("expected")
        specs = None if expected is None else tuple(ArraySpec.from_dict(d) for d in expected)
        return cls(**{**data, "expected": specs})


@dataclass(frozen=True)
class Parsed:
    """An accepted upload: what the sandbox read and, for a Keras file, wrote (at ``dest``)."""

    layout: str  # "fedsplit", "keras3" or "keras-legacy"
    specs: tuple[ArraySpec, ...]
    num_examples: int  # the count the upload is weighted by
    count_source: str  # "form", "file" or "none" (a template without a count)
    file_num_examples: int  # the file's own count (0: it has none)
    file_site: str | None  # the site the file names itself, if any
    model: str | None  # the file's model id, if any
    keras_layout: KerasLayout | None  # how to write the model back as Keras, for Keras uploads
    #: True: a canonical copy was written at ``dest`` (a Keras file); False: the file was checked
    #: where it lies and is stored as sent (fedsplit's own layout)
    rewritten: bool = False


@dataclass(frozen=True)
class Refused:
    """A refused upload: nothing was written."""

    reason: str
    message: str


InspectResult = Parsed | Refused


def result_to_json(result: InspectResult) -> str:
    """Serialise an answer for the parent (the child writes it to its result file)."""
    if isinstance(result, Refused):
        return json.dumps({"ok": False, **asdict(result)})
    data = asdict(result)
    data["specs"] = [s.to_dict() for s in result.specs]
    return json.dumps({"ok": True, **data})


def result_from_json(text: str) -> InspectResult:
    """Parse the child's answer; a malformed answer is a `Refused` with reason ``parser_crash``."""
    try:
        data = json.loads(text)
        if not data.pop("ok"):
            return Refused(reason=str(data["reason"]), message=str(data["message"]))
        data["specs"] = tuple(ArraySpec.from_dict(d) for d in data["specs"])
        return Parsed(**data)
    except (ValueError, KeyError, TypeError, AttributeError, FedsplitError) as e:
        return Refused(
            reason="parser_crash",
            message=(
                "The upload sandbox answered with a malformed result, so the upload was not "
                "stored. Try again; if it persists the coordinator's logs say why. "
                f"Received: {type(e).__name__}"
            ),
        )
