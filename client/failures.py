"""A hospital's failures, named at the source: which hospital, which stage, and the cause.

Everything a hospital's own data or code can break (its file, its recipe's reader, model,
training step or metrics, secure aggregation's checks) runs inside `hospital_stage`, which turns
any exception into one `HospitalFailure` line: ``hospital east, training: ValueError: ... (at
my_recipe.py:42 in train_step)``. `answered` wraps a ClientApp handler so that the failure goes
back to the coordinator as Flower's error reply with that line as its reason (never a Ray or
Python traceback), where it is recorded under the hospital's name.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fedsplit.protocol.errors import FedsplitError, HospitalFailure, one_line

#: Fixes for causes a hospital meets often, by exception type and message fragment.
_FIXES: tuple[tuple[type[BaseException], str, str], ...] = (
    (KeyError, "", "The file lacks what the reader looks for (e.g. its labels): give the "
                   "hospital a labelled file, or fix the recipe's read_data"),
    (FileNotFoundError, "", "Check the hospital's data path (node config data-path, --data, "
                            "--site NAME=FILE)"),
    (RuntimeError, "size mismatch", "Install the same recipe code at every hospital"),
)


def where(error: BaseException) -> str:
    """``file.py:LINE in function`` of the innermost frame of the hospital's own code that
    ``error`` passed through (else the innermost frame), or ``""``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    # the innermost frame of the hospital's own code: not a library's (site-packages, compiled
    # extensions, the standard library), else the innermost of all
    library = ("site-packages", "dist-packages", f"{Path(traceback.__file__).parent}")
    own = [f for f in frames if not f.filename.endswith(".pyx")
           and not any(part in f.filename for part in library)]
    last = (own or frames)[-1]
    return f"{Path(last.filename).name}:{last.lineno} in {last.name}"


def describe(error: BaseException) -> str:
    """One line: ``Type: message (at file.py:LINE in function)``; fedsplit's own errors as
    ``Type: message``."""
    text = str(error) if not isinstance(error, KeyError) else repr(error.args[0]) if error.args else ""
    if isinstance(error, FedsplitError):
        return one_line(f"{type(error).__name__}: {text}")
    at = where(error)
    return one_line(f"{type(error).__name__}: {text}" + (f" (at {at})" if at else ""))


def fix_for(error: BaseException) -> str:
    """The fix for a common cause, or ``""``."""
    for kind, fragment, fix in _FIXES:
        if isinstance(error, kind) and fragment in str(error):
            return fix
    return ""


@contextmanager
def hospital_stage(site: str, stage: str, fix: str = "") -> Iterator[None]:
    """Run a stage of hospital ``site``'s work; any exception becomes `HospitalFailure` naming
    the hospital, the stage and the cause (a `HospitalFailure` raised inside passes as it is)."""
    try:
        yield
    except HospitalFailure:
        raise
    except Exception as e:  # the hospital's own code may raise anything
        raise HospitalFailure(site, stage, describe(e), fix or fix_for(e)) from e


def answered(stage: str, site_of: Callable[..., str]) -> Callable[[Callable[..., object]],
                                                                   Callable[..., object]]:
    """Wrap a ClientApp handler ``(msg, context) -> Message``: a failure becomes Flower's error
    reply whose reason is the one-line `HospitalFailure` (``stage`` for failures no inner stage
    named; ``site_of(context)`` names the hospital)."""

    def wrap(handler: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(handler)
        def run(msg: object, context: object) -> object:
            try:
                return handler(msg, context)
            except Exception as e:  # every failure, named, goes back as the reply's error
                from flwr.app import Error, Message
                from flwr.common.constant import ErrorCode

                if not isinstance(e, HospitalFailure):
                    try:
                        name = site_of(context)
                    except Exception:  # the name itself may be what is misconfigured
                        name = "?"
                    e = HospitalFailure(name, stage, describe(e), fix_for(e))
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(e)),
                               reply_to=msg)

        return run

    return wrap
