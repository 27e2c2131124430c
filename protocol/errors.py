"""Every error fedsplit raises on purpose, and the one table of exit codes.

Each branch of the tree has its own exit code, so a script (or an operator reading ``$?``)
can tell what went wrong without parsing the message. The branches are defined here; the
packages that raise more specific errors subclass them (the subclass keeps its branch's code).

Tree (catch at any level)::

    FedsplitError                          1  an error with no more specific branch (a bug if seen)
    ├── ConfigError                        2  a CLI argument, run-config value or input table is invalid
    │   ├── ResumeMismatchError            2  --out holds a run with another config or other site data
    │   └── OverlapError                   2  vertical sites share too few patient IDs (server.vertical)
    ├── WeightFileError                    3  a weight file is missing, malformed or unsafe
    ├── UpdateError                        4  an update's arrays or sample count are invalid
    ├── AggregationError                   5  aggregation could not produce a model (aggregation.errors)
    │   ├── IncompatibleUpdatesError          updates disagree on names, shapes or dtypes
    │   ├── NotEnoughUpdatesError             too few usable updates for the strategy
    │   ├── UnknownStrategyError              no strategy registered under that name
    │   └── StrategyParamsError               a strategy parameter is missing, unknown or out of range
    ├── ReplyError                         6  a hospital's reply breaks the wire contract
    ├── FederationError                    7  hospitals failed or did not answer before round 1 (setup)
    ├── FlowerRunError                     8  Flower's runtime (SuperLink, `flwr run`) did not finish
    ├── AdminError                         9  the admin API refused a request (HTTP 4xx)
    │   ├── AuthenticationError               HTTP 401
    │   ├── PermissionDeniedError             HTTP 403
    │   ├── NotFoundError                     HTTP 404
    │   ├── ConflictError                     HTTP 409
    │   ├── UploadTooLargeError               HTTP 413
    │   └── UploadRefusedError                HTTP 422
    ├── UploadFailedError                 10  `fedsplit upload`: refused by the server, or it is unreachable
    ├── SiteAgentError                    11  `fedsplit site run`: the agent cannot run
    ├── ParallelRunError                  12  a worker of a multi-process (--parallel) training run failed
    ├── HospitalFailure                   13  a hospital's own data or code failed at one stage (named)
    └── NoTrainingError                   14  the run trained no round (or fewer than its quorum)

Exit code 130 means interrupted (Ctrl-C); click's own usage errors also exit 2. Every message
says what was expected, what to do about it, and ends with ``Received: <value>``.
"""

from __future__ import annotations


class FedsplitError(Exception):
    """Base class of every error fedsplit raises on purpose.

    ``reason`` is a short machine-readable code (``link``, ``non_finite``, ``num_examples``, ...)
    for metrics and API clients; the message is for people.
    """

    exit_code: int = 1
    reason: str | None = None

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
        if reason is not None:
            self.reason = reason


class ConfigError(FedsplitError, ValueError):
    """A CLI argument, run configuration value or input table is invalid."""

    exit_code = 2


class ResumeMismatchError(ConfigError):
    """An output folder holds a run whose configuration or site data differ from this one."""

    reason = "resume_mismatch"


class WeightFileError(FedsplitError, ValueError):
    """A weight file is not a valid, safe fedsplit weight file."""

    exit_code = 3
    reason = "invalid"


class UpdateError(FedsplitError, ValueError):
    """An update (named arrays plus sample count) is invalid."""

    exit_code = 4
    reason = "invalid"


class AggregationError(FedsplitError):
    """Aggregation could not produce a model."""

    exit_code = 5


class ReplyError(FedsplitError, ValueError):
    """A hospital's reply does not follow the wire contract (missing or unexpected records/keys)."""

    exit_code = 6
    reason = "reply"


class FederationError(FedsplitError):
    """Hospitals failed, or too few answered, while the federation was being set up."""

    exit_code = 7


class FlowerRunError(FedsplitError):
    """Flower's runtime did not complete the run."""

    exit_code = 8


class AdminError(FedsplitError):
    """The admin API refused a request."""

    exit_code = 9


class UploadFailedError(FedsplitError):
    """The server refused the upload, or could not be reached."""

    exit_code = 10


class SiteAgentError(FedsplitError):
    """The hospital agent cannot run (refused by the SuperLink, or misconfigured)."""

    exit_code = 11


class ParallelRunError(FedsplitError, RuntimeError):
    """A worker process of a multi-process training run failed or did not finish in time."""

    exit_code = 12


#: The stages at which a hospital's own data or code runs (`HospitalFailure.stage`).
STAGES = ("reading its data", "building the model", "loading the global model", "training",
          "scoring", "secure aggregation", "summary", "its policy", "checking the app")


class HospitalFailure(FedsplitError):
    """A hospital's own data or code failed at one stage, named with the hospital and the cause.

    The message is one line: ``hospital NAME, STAGE: CAUSE`` and, where there is one, the fix
    (a party that is not a hospital, e.g. ``the centralized baseline``, is named as given).
    The hospital agent raises it at the source (`client.failures`); the coordinator records it
    per hospital in the run record, never by Flower node id.
    """

    exit_code = 13
    reason = "hospital"

    def __init__(self, site: str, stage: str, cause: str, fix: str = "") -> None:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}. Received: {stage!r}")
        self.site, self.stage, self.cause, self.fix = site, stage, one_line(cause), one_line(fix)
        who = site if " " in site else f"hospital {site}"  # e.g. "the centralized baseline"
        text = f"{who}, {stage}: {self.cause}"
        super().__init__(f"{text}. {self.fix}" if self.fix else text)

    @classmethod
    def from_line(cls, line: str) -> HospitalFailure:
        """A failure already written as one line (e.g. recorded by the coordinator)."""
        error = cls.__new__(cls)
        FedsplitError.__init__(error, one_line(line, limit=2000))
        return error


class NoTrainingError(FedsplitError):
    """The run ended without training a round (or fewer than its quorum): no model to present."""

    exit_code = 14
    reason = "no_training"


def one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (whitespace runs and ANSI colour codes collapsed), at most ``limit``
    characters."""
    import re

    flat = " ".join(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(text)).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def error_from_record(text: str | None) -> FedsplitError | None:
    """The fedsplit error a run record's ``error`` (``"ClassName: message"``, as the coordinator
    writes it) names, rebuilt with its class (and so its exit code); None for any other text."""
    name, sep, message = (text or "").partition(": ")
    if not sep:
        return None
    todo: list[type[FedsplitError]] = [FedsplitError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            error = FedsplitError.__new__(cls)
            FedsplitError.__init__(error, one_line(message, limit=2000))
            return error
        todo.extend(cls.__subclasses__())
    return None


def exit_codes() -> dict[int, str]:
    """Every exit code of the tree's branches and the error class it stands for."""
    codes: dict[int, str] = {}
    todo: list[type[FedsplitError]] = [FedsplitError]
    while todo:
        cls = todo.pop()
        codes.setdefault(cls.exit_code, cls.__name__)
        todo.extend(cls.__subclasses__())
    return dict(sorted(codes.items()))
