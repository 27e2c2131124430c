"""Parses one untrusted upload; runs only in a sandbox child (see `server.admin.sandbox`).

The child process limits its own address space, CPU time and file size (and refuses to parse
at all, reason ``sandbox_limits``, when any limit cannot be set), empties HDF5's plugin search
path, checks the file's structure (`protocol.keras_layout.open_upload`, which walks it with
`protocol.h5safety`) before reading any value, compares names, shapes and dtypes with the
round's model (`protocol.arrays.layout_difference`), reads and checks every value (finite
floats). A file in fedsplit's own layout is checked where it lies, block by block (at most
`CHECK_BLOCK_VALUES` values in memory at a time), and stored as it was sent: no second copy on
disk, whatever the model's size. A Keras file is rewritten as a canonical fedsplit weight file
with the protocol's writer (its values in memory once). The coordinator opens only files this
sandbox has read to the last value with the same reader (`protocol.weights.open_weights`). The
answer is a typed `server.admin.inspection.InspectResult`, written as JSON for the parent.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from fedsplit.aggregation._blocks import plan_blocks
from fedsplit.protocol import h5safety
from fedsplit.protocol.arrays import ArraySpec, check_array, layout_difference
from fedsplit.protocol.errors import FedsplitError, UpdateError, WeightFileError
from fedsplit.protocol.keras_layout import FEDSPLIT, open_upload
from fedsplit.protocol.update import Update
from fedsplit.protocol.weights import WeightFile, open_weights, write_weights
from fedsplit.server.admin.errors import UploadRefusedError
from fedsplit.server.admin.inspection import InspectRequest, InspectResult, Parsed, Refused, result_to_json

#: Advice every model-mismatch refusal ends with.
MISMATCH_HINT = (
    "Every site must train the round's model from its start model "
    "(GET /api/v1/rounds/{id}/start-model)."
)


#: No hospital cohort is larger; a bigger count is a bug or an attempt to dominate the average.
MAX_NUM_EXAMPLES = 10**9
#: Values read at a time when a fedsplit-layout upload is checked in place (32 MiB of float64).
CHECK_BLOCK_VALUES = 4 * 1024 * 1024


class SandboxLimitsError(Exception):
    """The child could not set one of its resource limits; it must not parse."""


def run(source: str, dest: str, request: InspectRequest, result_path: str) -> None:
    """Child-process entry point: limit resources, inspect, write the result as JSON."""
    try:
        limit_resources(request)
    except SandboxLimitsError as e:
        result: InspectResult = Refused(
            reason="sandbox_limits",
            message=(
                f"The upload sandbox could not set its resource limits ({e}), so it refused to "
                f"parse the file; the upload was not stored. The coordinator must fix its "
                f"limits (--parse-memory-mb, the process's hard limits) and the upload be sent "
                f"again. Received: {e}"
            ),
        )
    else:
        result = _inspect_safely(Path(source), Path(dest), request)
    tmp = Path(result_path + ".tmp")
    tmp.write_text(result_to_json(result))
    os.replace(tmp, result_path)


def _inspect_safely(source: Path, dest: Path, request: InspectRequest) -> InspectResult:
    try:
        return inspect(source, dest, request)
    except UploadRefusedError as e:
        return Refused(reason=str(e.reason), message=str(e))
    except (WeightFileError, UpdateError) as e:
        return Refused(reason=str(e.reason), message=str(e))
    except MemoryError:
        return Refused(
            reason="too_large",
            message=(
                f"Parsing the uploaded file needed more than the sandbox's {request.memory_mb} MB "
                f"of memory; upload the round's model. Received: out of memory"
            ),
        )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, FedsplitError) as e:
        return Refused(
            reason="corrupt",
            message=(
                f"The uploaded file is truncated or corrupt: reading it failed ({type(e).__name__}: "
                f"{_short(e)}). Re-export it and upload again. Received: {type(e).__name__}"
            ),
        )


def inspect(source: Path, dest: Path, request: InspectRequest) -> Parsed:
    """Validate ``source``; write its canonical fedsplit copy to ``dest`` only when it is a Keras
    file (``Parsed.rewritten``): a fedsplit-layout file is checked in place and kept as sent."""
    h5safety.disable_plugins()
    with open(source, "rb") as fh:
        keras = open_upload(fh, max_depth=request.max_depth, max_elements=request.max_elements,
                            max_total_elements=request.max_total_elements)
        if keras is not None:
            with keras:
                check_expected(request.expected, keras.specs)
                check_declared_size(request, keras.specs)
                count, count_source = _resolve_count(request, 0)
                arrays = {spec.name: keras.array(spec.name) for spec in keras.specs}
            write_weights(Update(arrays=arrays, num_examples=count, site=request.site,
                                 round=request.round, model=None), dest)
            specs, layout, descriptor = keras.specs, keras.kind, keras.layout
            file_count, file_site, model = 0, None, None
        else:
            fh.seek(0)
            with open_weights(
                fh, require_num_examples=False, max_elements=request.max_total_elements
            ) as wf:
                header = wf.header
                check_expected(request.expected, header.specs)
                check_declared_size(request, header.specs)
                file_count, file_site, model = header.num_examples, header.site, header.model
                count, count_source = _resolve_count(request, file_count)
                check_values(wf)
            specs, layout, descriptor = header.specs, FEDSPLIT, None
    return Parsed(
        layout=layout,
        specs=tuple(specs),
        num_examples=count,
        count_source=count_source,
        file_num_examples=file_count,
        file_site=file_site,
        model=model,
        keras_layout=descriptor,
        rewritten=keras is not None,
    )


def check_values(wf: WeightFile, block_values: int = CHECK_BLOCK_VALUES) -> None:
    """Read every value of ``wf`` (finite floats, readable chunks), at most ``block_values`` at a
    time: the check's memory is one block, whatever the model's size. A refusal names the
    parameter and the non-finite values of the first block holding any."""
    specs = wf.header.specs
    buffers: dict[np.dtype, np.ndarray] = {}
    for block in plan_blocks(specs, block_values):
        spec = wf.spec(block.name)
        dtype = np.dtype(spec.dtype).newbyteorder("=")
        if dtype not in buffers:
            buffers[dtype] = np.empty(min(block_values, max(s.size for s in specs)), dtype)
        out = buffers[dtype][: block.size]
        if block.selection == ():
            wf.read_into(block.name, out)
        else:
            wf.read_into(block.name, out, start=block.hyperslab_start, count=block.hyperslab_count)
        try:  # check_array's own refusal; for a parameter cut in blocks it counts one block
            check_array(block.name, out, where=wf.where)
        except UpdateError as e:
            raise WeightFileError(str(e), reason=e.reason) from e


def check_declared_size(request: InspectRequest, specs: Sequence[ArraySpec]) -> None:
    """Refuse (``too_large``) a file whose values, decompressed, would exceed the cap, from the
    shapes it declares: before any value is read or decompressed (a 1 MiB gzip file declaring
    1 GiB of zeros was read, 17 s and 1.33 GiB, and stored as 1 GiB)."""
    declared = sum(spec.nbytes for spec in specs)
    if declared > request.max_total_bytes:
        raise UploadRefusedError(
            f"The uploaded file declares {declared} bytes of values once decompressed, more than "
            f"{request.max_total_bytes} bytes ({request.cap_source}). Upload the round's model; "
            f"for a larger model the coordinator uploads it as the round's template first, or "
            f"raises --max-model-mb. Received: {declared} bytes declared",
            "too_large",
        )


def check_expected(expected: Sequence[ArraySpec] | None, specs: Sequence[ArraySpec]) -> None:
    """Refuse (``model_mismatch``) an upload whose layout differs from the round's model.

    Parameters are matched by name; their order in the file does not matter.
    """
    if expected is None:
        return
    problem = layout_difference(
        expected, specs, expected_label="the round's model", got_label="the upload", ordered=False
    )
    if problem is not None:
        names = [s.name for s in specs][:20]
        raise UploadRefusedError(
            f"{problem} {MISMATCH_HINT} Received: parameters {names}", "model_mismatch"
        )


def _resolve_count(request: InspectRequest, file_count: int) -> tuple[int, str]:
    if request.num_examples is not None:
        return request.num_examples, "form"
    if file_count > MAX_NUM_EXAMPLES:  # e.g. 2**64-1: refused for what it is, not as a crash
        raise UploadRefusedError(
            f"The file's num_examples attribute is {file_count}, over {MAX_NUM_EXAMPLES}, which no "
            f"hospital cohort reaches. Write the number of training rows (`fedsplit export ... "
            f"--num-examples N`) or send form field num_examples. Received: {file_count}",
            "num_examples",
        )
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


def limit_resources(request: InspectRequest) -> None:
    """Set the child's address-space, CPU, file-size and core limits; raise if any fails."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
    except (OSError, ValueError, IndexError) as e:
        raise SandboxLimitsError(f"cannot read the process size from /proc/self/statm: {e}") from e
    memory = pages * resource.getpagesize() + request.memory_mb * 1024 * 1024
    limits = (
        ("RLIMIT_AS", resource.RLIMIT_AS, memory, memory),
        ("RLIMIT_CPU", resource.RLIMIT_CPU, request.cpu_s, request.cpu_s + 1),
        ("RLIMIT_FSIZE", resource.RLIMIT_FSIZE, request.max_output_bytes, request.max_output_bytes),
        ("RLIMIT_CORE", resource.RLIMIT_CORE, 0, 0),
    )
    for label, which, soft, hard in limits:
        try:
            resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError, OverflowError) as e:
            raise SandboxLimitsError(
                f"setrlimit({label}, ({soft}, {hard})) failed: {type(e).__name__}: {e}"
            ) from e


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= 200 else text[:200] + "..."
