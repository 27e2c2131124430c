"""Property-based API test of the admin API against its own OpenAPI schema.

schemathesis generates 100 requests per operation and mode (valid, then invalid ones),
derandomized so every run sends the same requests, and each is sent in process through the
ASGI app three times: with the admin token, with a site token and with no token. Any 5xx
answer, or an answer the schema does not document (status code, content type, body schema),
fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from fedsplit.server.admin.app import create_app
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.sandbox import Sandbox
from fedsplit.server.admin.store import add_site
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.admin.conftest import ADMIN, ADMIN_TOKEN, TEST_HOSTS, bearer, post_file, write_model

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
TOKENS: dict[str, str] = {}
#: Generated examples per operation and generation mode.
EXAMPLES = 100


@pytest.fixture
def api_schema(tmp_path: Path, sandbox: Sandbox) -> Iterator[schemathesis.BaseSchema]:
    """The app over a database holding rounds in every state, and its schema."""
    data_dir = tmp_path / "admin-data"
    app = create_app(
        AdminSettings(data_dir=data_dir, admin_token=ADMIN_TOKEN, max_upload_mb=1.0,
                      allowed_hosts=TEST_HOSTS),
        sandbox=sandbox,
    )
    TOKENS["admin"] = ADMIN_TOKEN
    TOKENS["site"] = add_site(data_dir=data_dir, name="hospital-a", cohort_size=1000)
    with TestClient(app) as client:
        # round 1: aggregated; round 2: open with one upload; round 3: open and empty
        for _ in range(3):
            assert client.post("/api/v1/rounds", json={}, headers=ADMIN).status_code == 201
        for round_id in (1, 2):
            model = write_model(tmp_path / f"m{round_id}.h5", num_examples=10)
            assert post_file(client, round_id, TOKENS["site"], model).status_code == 201
        assert client.post("/api/v1/rounds/1/aggregate", headers=ADMIN).status_code == 200
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


def operations(api_schema: schemathesis.BaseSchema) -> list[schemathesis.APIOperation]:
    """Every operation of the schema (a schema the loader cannot read fails here)."""
    return [result.ok() for result in api_schema.get_all_operations()]


@pytest.mark.slow  # 300 requests per operation and mode: about 3.5 min on a loaded 2-core machine
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_admin_api_answers_only_documented_responses(api_schema, mode: GenerationMode) -> None:
    """No generated request, sent as the admin, as a site and with no token, gets 5xx or an
    undocumented answer.

    ``mode`` POSITIVE generates requests the schema allows, NEGATIVE requests it forbids.
    """
    ops = operations(api_schema)
    assert len(ops) >= 8
    for operation in ops:
        inputs = (operation.path_parameters, operation.query, operation.headers, operation.body)
        if mode is GenerationMode.NEGATIVE and not any(len(part) for part in inputs):
            continue  # /healthz, /metrics: nothing to send wrong

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:
            for role in ("admin", "site", None):
                headers = bearer(TOKENS[role]) if role else {}
                case.call_and_validate(headers=headers, checks=CHECKS)

        run()
