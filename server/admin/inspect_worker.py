"""Parses one untrusted upload; runs only in a sandbox child (see `server.admin.sandbox`).

The child process limits its own address space, CPU time and file size, empties HDF5's plugin
search path, checks the file's structure (`h5safety.walk`) before reading any value, compares
names and shapes with the round's model, reads and checks every value (finite floats), and
writes a canonical fedsplit weight file with the protocol's writer. The coordinator only ever
opens files this canonical writer produced. The result is a small JSON-friendly dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import h5py.h5pl
import numpy as np

from protocol import h5safety
from protocol.arrays import check_array
from protocol.errors import FedsplitError, UpdateError, WeightFileError
from protocol.update import Update
from protocol.weights import open_weights, write_weights
from server.admin import keras_layout
from server.admin.errors import UploadRefusedError
from server.admin.model_match import first_difference, specs_to_json


@dataclass(frozen=True)
class InspectRequest:
    """What the coordinator tells the worker about one upload."""

    max_elements: int
    max_total_elements: int
    max_depth: int
    expected: list[dict[str, Any]] | None
    num_examples: int | None
    require_count: bool
    site: str | None
    round: int | None
    memory_mb: int
    cpu_s: int
    max_output_bytes: int


def run(source: str, dest: str, request: InspectRequest, result_path: str) -> None:
    """Child-process entry point: limit resources, inspect, write the result as JSON."""
    _limit_resources(request)
    try:
        result = inspect(Path(source), Path(dest), request)
    except UploadRefusedError as e:
        result = {"ok": False, "reason": e.reason, "message": str(e)}
    except (WeightFileError, UpdateError) as e:
        result = {"ok": False, "reason": e.reason, "message": str(e)}
    except MemoryError:
        result = {
            "ok": False,
            "reason": "too_large",
            "message": (
                f"Parsing the uploaded file needed more than the sandbox's {request.memory_mb} MB "
                f"of memory; upload the round's model. Received: out of memory"
            ),
        }
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, FedsplitError) as e:
        result = {
            "ok": False,
            "reason": "corrupt",
            "message": (
                f"The uploaded file is truncated or corrupt: reading it failed ({type(e).__name__}: "
                f"{_short(e)}). Re-export it and upload again. Received: {type(e).__name__}"
            ),
        }
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)


def inspect(source: Path, dest: Path, request: InspectRequest) -> dict[str, Any]:
    """Validate ``source`` and write its canonical fedsplit copy to ``dest``."""
    _disable_plugins()
    size = source.stat().st_size
    with open(source, "rb") as fh:
        if not h5safety.looks_like_hdf5(fh, size):
            raise UploadRefusedError(
                "The uploaded file is not HDF5 (no HDF5 signature). Upload a fedsplit weight file "
                "(`fedsplit export CHECKPOINT.pt --num-examples N -o FILE.h5`) or a Keras "
                f"save_weights file. Received: {size} bytes starting {_head(fh)!r}",
                "not_hdf5",
            )
        try:
            f = h5py.File(fh, "r")
        except (OSError, ValueError) as e:
            raise UploadRefusedError(
                f"The uploaded file has an HDF5 signature but cannot be opened: it is truncated or "
                f"corrupt ({_short(e)}). Re-export it and upload again. Received: {size} bytes",
                "corrupt",
            ) from None
        with f:
            layout = keras_layout.detect_layout(f)
            tree = h5safety.walk(f, where=keras_layout.WHERE, max_depth=request.max_depth,
                                max_elements=request.max_elements)
            descriptor = None
            if layout != keras_layout.FEDSPLIT:
                descriptor, specs = keras_layout.describe_keras(
                    f, layout, tree, request.max_total_elements
                )
                spec_json = specs_to_json(specs)
                _check_expected(request, spec_json)
                file_count, file_site, model = 0, None, None
                count, source_of_count = _resolve_count(request, 0)
                arrays = {}
                for ds in descriptor["datasets"]:
                    arr = keras_layout.read_keras_array(f, ds["path"])
                    arrays[ds["name"]] = _checked(ds["name"], arr)
        if layout == keras_layout.FEDSPLIT:
            fh.seek(0)
            with open_weights(
                fh, require_num_examples=False, max_elements=request.max_total_elements
            ) as wf:
                header = wf.header
                spec_json = specs_to_json(header.specs)
                _check_expected(request, spec_json)
                file_count, file_site, model = header.num_examples, header.site, header.model
                count, source_of_count = _resolve_count(request, file_count)
                arrays = {name: wf.array(name) for name in header.names}
    update = Update(
        arrays=arrays, num_examples=count, site=request.site, round=request.round, model=model
    )
    write_weights(update, dest)
    return {
        "ok": True,
        "layout": layout,
        "specs": spec_json,
        "num_examples": count,
        "count_source": source_of_count,
        "file_num_examples": file_count,
        "file_site": file_site,
        "keras_layout": descriptor,
    }


def _check_expected(request: InspectRequest, specs: list[dict[str, Any]]) -> None:
    if request.expected is None:
        return
    problem = first_difference(request.expected, specs)
    if problem is not None:
        raise UploadRefusedError(problem, "model_mismatch")


def _resolve_count(request: InspectRequest, file_count: int) -> tuple[int, str]:
    if request.num_examples is not None:
        return request.num_examples, "form"
    if file_count >= 1:
        return file_count, "file"
    if not request.require_count:
        return 1, "none"
    raise UploadRefusedError(
        "The upload carries no sample count: the file has no 'num_examples' attribute and the form "
        "has no num_examples field. FedAvg weights every upload by its count; send the number of "
        "training rows (`fedsplit upload ... --num-examples 1200`, or form field num_examples). "
        "Received: no count",
        "num_examples",
    )


def _checked(name: str, arr: np.ndarray) -> np.ndarray:
    try:
        return check_array(name, arr, where="uploaded file")
    except UpdateError as e:
        raise UploadRefusedError(str(e), e.reason) from None


def _limit_resources(request: InspectRequest) -> None:
    with contextlib.suppress(OSError, ValueError):
        pages = int(Path("/proc/self/statm").read_text().split()[0])
        current = pages * resource.getpagesize()
        limit = current + request.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_CPU, (request.cpu_s, request.cpu_s + 1))
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_FSIZE, (request.max_output_bytes, request.max_output_bytes))
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _disable_plugins() -> None:
    """Empty HDF5's plugin search path: no filter plugin library can be loaded."""
    while h5py.h5pl.size() > 0:
        h5py.h5pl.remove(0)


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= 200 else text[:200] + "..."


def _head(fh: Any) -> bytes:
    fh.seek(0)
    return fh.read(8)
