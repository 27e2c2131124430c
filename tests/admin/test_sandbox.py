"""The upload sandbox: its typed answer, and its refusal to parse without resource limits."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.server.admin.errors import UploadRefusedError
from fedsplit.server.admin.inspection import (
    InspectRequest,
    Parsed,
    Refused,
    result_from_json,
    result_to_json,
)
from fedsplit.server.admin.sandbox import Sandbox

from tests.admin.conftest import ADMIN, create_round, post_file, write_model

SPECS = (ArraySpec("w", (2, 3), np.dtype("float32")), ArraySpec("b", (2,), np.dtype("float16")))


def request(**changes: object) -> InspectRequest:
    base = InspectRequest(
        max_elements=1000, max_total_elements=1000, max_total_bytes=8000, cap_source="a test's cap",
        max_depth=8, expected=None, num_examples=None,
        require_count=True, site="hospital-a", round=1, memory_mb=1024, cpu_s=30,
        max_output_bytes=64 * 1024 * 1024,
    )
    return dataclasses.replace(base, **changes)


def test_request_and_answers_survive_their_json_form() -> None:
    """Specs cross the process boundary as dicts and come back as ArraySpec."""
    req = request(expected=SPECS)
    assert InspectRequest.from_json(req.to_json()) == req
    parsed = Parsed(layout="fedsplit", specs=SPECS, num_examples=12, count_source="file",
                    file_num_examples=12, file_site=None, model="m", keras_layout=None)
    assert result_from_json(result_to_json(parsed)) == parsed
    refused = Refused(reason="non_finite", message="NaN. Received: 1")
    assert result_from_json(result_to_json(refused)) == refused


def test_malformed_answer_is_a_parser_crash() -> None:
    """A child answer that is not the result form is refused, never half-trusted."""
    for text in ("", "{}", '{"ok": true, "layout": "fedsplit"}', "[1]",
                 '{"ok": true, "specs": [{"name": "w"}]}'):
        got = result_from_json(text)
        assert isinstance(got, Refused) and got.reason == "parser_crash", text


def test_sandbox_answers_with_a_typed_result(sandbox: Sandbox, tmp_path: Path) -> None:
    """A good file comes back as Parsed with ArraySpec specs; a fedsplit-layout file is checked
    where it lies, with no copy written (issue 43: an upload costs its size once on disk)."""
    source = write_model(tmp_path / "a.h5", num_examples=7, model="mlp")
    dest = tmp_path / "canonical.h5"
    got = sandbox.inspect(source, dest, request())
    assert isinstance(got, Parsed)
    assert [s.name for s in got.specs] == ["layer.0.weight", "layer.0.bias", "layer.1.weight"]
    assert got.specs[0] == ArraySpec("layer.0.weight", (3, 4), np.dtype("float32"))
    assert (got.num_examples, got.count_source, got.model, got.layout) == (7, "file", "mlp",
                                                                          "fedsplit")
    assert not got.rewritten and not dest.exists()


def test_sandbox_that_cannot_set_its_limits_refuses_to_parse(
    sandbox: Sandbox, tmp_path: Path, caplog
) -> None:
    """setrlimit really fails (an address-space limit beyond what the kernel can hold): refused."""
    source = write_model(tmp_path / "a.h5")
    dest = tmp_path / "canonical.h5"
    caplog.set_level(logging.ERROR, logger="fedsplit.server.admin.sandbox")
    with pytest.raises(UploadRefusedError) as refused:
        sandbox.inspect(source, dest, request(memory_mb=2**44))
    caught = refused.value
    assert caught.reason == "sandbox_limits"
    assert "setrlimit(RLIMIT_AS" in str(caught) and "Received:" in str(caught)
    assert not dest.exists()
    assert any("could not set its resource limits" in r.getMessage() for r in caplog.records)


def test_upload_is_refused_when_the_sandbox_has_no_limits(
    make_client, site_token, tmp_path: Path, caplog
) -> None:
    """Through the API: 422 with reason sandbox_limits, nothing stored, the log says why."""
    client = make_client(parse_memory_mb=2**44)
    token = site_token("hospital-a")
    rnd = create_round(client)
    caplog.set_level(logging.ERROR, logger="fedsplit.server.admin.sandbox")
    response = post_file(client, rnd["id"], token, write_model(tmp_path / "a.h5"))
    assert response.status_code == 422
    assert response.json()["reason"] == "sandbox_limits"
    assert "could not set its resource limits" in response.json()["detail"]
    assert client.get(f"/api/v1/rounds/{rnd['id']}", headers=ADMIN).json()["uploads"] == []
    assert any("sandbox_limits" in r.getMessage() or "resource limits" in r.getMessage()
               for r in caplog.records)
