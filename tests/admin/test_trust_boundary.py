"""Issue 33, the trust boundary's second pass: each defect's attack, on the app itself.

The live-server probes (forwarded headers, a never-read body on a real socket, slow clients) are
in test_trust_live.py.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
from fastapi.testclient import TestClient
from fedsplit.protocol import Update, read_weights, write_weights
from fedsplit.protocol.errors import ConfigError
from fedsplit.server.admin import audit
from fedsplit.server.admin.connections import forwarded_settings
from fedsplit.server.admin.inspection import InspectRequest
from fedsplit.server.admin.sandbox import Sandbox
from fedsplit.server.admin.services import uploads as upload_service
from fedsplit.server.admin.store import add_site, remove_site
from fedsplit.server.admin.tables import Round
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from tests._helpers.weight_files import raw_weights
from tests.admin.asgi import call
from tests.admin.conftest import (
    ADMIN,
    ADMIN_TOKEN,
    bearer,
    create_round,
    forge_audit_record,
    model_arrays,
    post_file,
    verify_audit,
    write_model,
)

REPO = Path(__file__).resolve().parents[2]

SAME_ORIGIN = {"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}


# 5. Bodies the app never reads were drained forever ---------------------------------------------
def test_answer_before_the_body_closes_the_connection(client):
    """A 405 (and any answer the app makes before reading the body to its end) carries
    `Connection: close`, so the server stops reading; answers to bodiless requests and to bodies
    read to their end keep the connection."""
    endless = (b"x" * 65536 for _ in range(10_000))  # 655 MB if it were read; produced lazily
    refused = call(client.app, "POST", "/healthz",
                   {"host": "testserver", "transfer-encoding": "chunked"}, endless)
    assert refused.status == 405 and refused.headers.get("connection") == "close"
    assert refused.bytes_read < 1024 * 1024
    plain = call(client.app, "GET", "/healthz", {"host": "testserver"})
    assert plain.status == 200 and "connection" not in plain.headers
    read = call(client.app, "POST", "/ui/login", {"host": "testserver", "content-length": "8",
                "content-type": "application/x-www-form-urlencoded"}, [b"token=ab"])
    assert "connection" not in read.headers, read.status


# 2. A hospital read another hospital's weights ----------------------------------------------------
def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _flat(path: Path) -> np.ndarray:
    update = read_weights(path)
    return np.concatenate([update.arrays[k].ravel() for k in sorted(update.arrays)]).astype(np.float64)


def test_zero_update_trick_is_refused(client, site_token, tmp_path):
    """Probe: hosp-a uploaded all-zero weights with num_examples=1, hosp-b its real weights with
    4000; hosp-a downloaded the aggregate (2 hospitals >= the minimum of 2) and got hosp-b's
    weights to cosine 1.000000. Now one other hospital holding more than 60% of the aggregate's
    weight keeps it from hosp-a; the refusal names and counts no one."""
    a, b = site_token("hosp-a"), site_token("hosp-b")
    rnd = create_round(client)
    rng = np.random.default_rng(7)
    real = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in model_arrays().items()}
    b_file = write_weights(Update(arrays=real, num_examples=4000), tmp_path / "b.h5")
    assert post_file(client, rnd["id"], a, write_model(tmp_path / "zeros.h5", 0.0),
                     num_examples=1).status_code == 201
    assert post_file(client, rnd["id"], b, b_file).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    admin_copy = tmp_path / "aggregate.h5"
    admin_copy.write_bytes(client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=ADMIN).content)
    assert _cosine(_flat(admin_copy), _flat(b_file)) > 0.999999  # what hosp-a would have read
    refused = client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(a))
    assert refused.status_code == 403
    detail = refused.json()["detail"]
    assert "one other hospital holds more than 60%" in detail
    assert "hosp-b" not in detail and "4000" not in detail and not re.search(r"\b2 hospital", detail)
    assert client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(b)).status_code == 200
    sign_in = TestClient(client.app)
    assert sign_in.post("/ui/login", data={"token": a}, headers=SAME_ORIGIN,
                        follow_redirects=False).status_code == 303
    page = sign_in.get(f"/ui/rounds/{rnd['id']}").text
    assert f"/ui/rounds/{rnd['id']}/model" not in page  # no link either
    assert sign_in.get(f"/ui/rounds/{rnd['id']}/model").status_code == 403


def test_dominance_and_own_share_are_settings(make_client, site_token, tmp_path):
    """Balanced hospitals get the aggregate; a hospital whose own share is negligible does not
    (--min-own-share, a fraction of an equal share); --max-site-share moves the dominance line."""
    client = make_client(max_site_share=0.9)
    tokens = [site_token(f"hosp-{c}") for c in "abc"]
    rnd = create_round(client)
    for token, n, value in zip(tokens, (1, 500, 700), (0.0, 1.0, 2.0), strict=True):
        assert post_file(client, rnd["id"], token, write_model(tmp_path / f"{n}.h5", value),
                         num_examples=n).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    model = f"/api/v1/rounds/{rnd['id']}/model"
    small = client.get(model, headers=bearer(tokens[0]))
    assert small.status_code == 403 and "negligible share" in small.json()["detail"]
    assert client.get(model, headers=bearer(tokens[1])).status_code == 200  # c holds 58%
    strict = make_client(max_site_share=0.5)
    assert strict.get(model, headers=bearer(tokens[1])).json()["reason"] is None
    assert "more than 50%" in strict.get(model, headers=bearer(tokens[1])).json()["detail"]


# 3 and 4. Decompression and chunk-count bombs; replaced uploads; quota; uploads at once ---------
MIB = 1024 * 1024
#: Runs the upload parser (inspect_worker, as the sandbox's child does) on each file in a forked
#: child of one fresh interpreter; prints each answer with the peak resident memory of the
#: children so far (a running maximum: each child's peak is at most that).
PARSER_PEAK = """
import json, os, resource, sys
from pathlib import Path
from fedsplit.server.admin import inspect_worker
from fedsplit.server.admin.inspection import InspectRequest, result_to_json
request = InspectRequest.from_json(json.loads(sys.argv[1]))
out = Path(sys.argv[2])
for source in sys.argv[3:]:
    pid = os.fork()
    if pid == 0:
        result = inspect_worker._inspect_safely(Path(source), out, request)
        Path(str(out) + ".json").write_text(result_to_json(result))
        os._exit(0)
    os.waitpid(pid, 0)
    answer = json.loads(Path(str(out) + ".json").read_text())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"source": source, "answer": answer, "peak": peak}))
"""


def gzip_bomb(path: Path, values: int, chunk: int = MIB) -> Path:
    """A fedsplit-looking file declaring ``values`` float32 zeros, gzip-compressed: each chunk of
    ``chunk`` zeros is compressed once and written as it is (a few KiB per 4 MiB)."""
    packed = zlib.compress(np.zeros(chunk, np.float32).tobytes(), 9)

    def build(f: h5py.File, group: h5py.Group) -> None:
        ds = group.create_dataset("w", shape=(values,), dtype=np.float32, chunks=(chunk,),
                                  compression="gzip")
        for i in range(values // chunk):
            ds.id.write_direct_chunk((i * chunk,), packed)

    return raw_weights(path, build)


def chunk_bomb(path: Path, chunks: int) -> Path:
    """A 7 KB file declaring ``chunks`` one-value chunks (none written: the reader fills them)."""
    return raw_weights(path, lambda f, group: group.create_dataset(
        "w", shape=(chunks,), dtype=np.float32, chunks=(1,)))


def parser_peaks(paths: list[Path], request: InspectRequest, tmp_path: Path) -> dict[str, dict]:
    """The parser's answer to each file and the peak resident memory (bytes) so far."""
    done = subprocess.run([sys.executable, "-c", PARSER_PEAK, json.dumps(request.to_json()),
                           str(tmp_path / "canonical.h5"), *map(str, paths)], capture_output=True,
                          text=True, timeout=120, check=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {entry["source"]: entry for entry in found}


def _first_upload_request(client: TestClient) -> InspectRequest:
    ctx = client.app.state.admin
    return upload_service._request(ctx, Round(id=1, strategy="fedavg"), num_examples=5,
                                   require_count=True, site="hosp-a")


def test_gzip_and_chunk_bombs_are_refused_before_any_value_is_read(make_client, site_token, tmp_path,
                                                                   data_dir):
    """Probes: a 1 MiB gzip file declaring 256 Mi float32 zeros (1 GiB), sent to a round with no
    model yet, was accepted after 17 s of parsing, a 1.33 GiB parser and +1,025 MiB on disk; a
    7 KB file declaring 2x10^5 one-value chunks made its parser peak at hundreds of MiB (3.75 GiB
    for 10^6). Now the declared size (--max-model-mb, here 128 MiB, for a first upload) and the
    chunks (at most 32,768, small ones only a few) are checked from the metadata: refused at once.
    (Under the 1 GiB default since issue 43 the 1 GiB one is a model like any other: checked block
    by block, parser peak ~74 MiB, stored as sent, 1 MiB on disk.)"""
    client = make_client(max_upload_mb=512, max_model_mb=128)  # the files themselves are small
    token = site_token("hosp-a")
    rnd = create_round(client)
    bombs = {
        "1 GiB gzip": (gzip_bomb(tmp_path / "gib.h5", 256 * MIB), "too_large"),
        "256 MiB gzip": (gzip_bomb(tmp_path / "mib.h5", 64 * MIB), "too_large"),
        "2x10^5 chunks": (chunk_bomb(tmp_path / "chunks.h5", 200_000), "chunks"),
        "10^6 chunks": (chunk_bomb(tmp_path / "million.h5", 1_000_000), "chunks"),
    }
    parsed = parser_peaks([path for path, _ in bombs.values()], _first_upload_request(client), tmp_path)
    uploads = data_dir / "files" / "rounds" / str(rnd["id"]) / "uploads"
    for label, (path, reason) in bombs.items():
        started = time.perf_counter()
        response = post_file(client, rnd["id"], token, path, num_examples=5)
        seconds = time.perf_counter() - started
        answer, peak = parsed[str(path)]["answer"], parsed[str(path)]["peak"]
        print(f"{label}: {path.stat().st_size} bytes, answered {response.status_code} "
              f"{response.json().get('reason')} in {seconds:.2f} s; parser peak {peak / MIB:.0f} MiB")
        assert response.status_code == 422 and response.json()["reason"] == reason, label
        assert answer["ok"] is False and answer["reason"] == reason
        assert peak < 300 * 1000 * 1000, label
        assert not uploads.exists() or not any(uploads.iterdir())
    assert "declares 268435456 bytes of values once decompressed" in post_file(
        client, rnd["id"], token, bombs["256 MiB gzip"][0], num_examples=5).json()["detail"]


def test_replaced_uploads_are_pruned(make_client, site_token, tmp_path, data_dir):
    """Probe: three uploads to one round kept all three copies. The replaced ones keep their
    rows (history, sha256, size) and lose their files, at the commit and, for files an older
    server left, at start."""
    client = make_client()
    token = site_token("hosp-a")
    rnd = create_round(client)
    receipts = [post_file(client, rnd["id"], token, write_model(tmp_path / f"{i}.h5", float(i)))
                for i in range(3)]
    assert [r.status_code for r in receipts] == [201] * 3
    folder = data_dir / "files" / "rounds" / str(rnd["id"]) / "uploads"
    last = receipts[-1].json()["id"]
    assert sorted(p.name for p in folder.iterdir()) == [f"{last}.h5"]
    body = client.get(f"/api/v1/rounds/{rnd['id']}", headers=bearer(token)).json()
    assert [u["sha256"] for u in body["history"]] == [r.json()["sha256"] for r in receipts[:2]]
    left = folder / f"{receipts[0].json()['id']}.h5"  # as a server that kept them left it
    left.write_bytes(b"old copy")
    make_client()  # a server starting on this data directory
    assert not left.exists() and (folder / f"{last}.h5").exists()


def test_site_quota(make_client, site_token, tmp_path):
    """--site-quota-mb bounds what one hospital holds in open rounds; a replaced upload does not
    count (its files go), another hospital is not affected."""
    model = write_model(tmp_path / "m.h5", 1.0)
    # one upload fits, two do not (an upload is stored once: issue 43)
    client = make_client(site_quota_mb=1.5 * model.stat().st_size / 1024 / 1024)
    a, b = site_token("hosp-a"), site_token("hosp-b")
    first, second = create_round(client), create_round(client)
    assert post_file(client, first["id"], a, model).status_code == 201
    assert post_file(client, first["id"], a, model).status_code == 201  # replaces: fits
    over = post_file(client, second["id"], a, model)
    assert over.status_code == 422 and over.json()["reason"] == "quota"
    assert "--site-quota-mb" in over.json()["detail"]
    assert post_file(client, second["id"], b, model).status_code == 201


class _HeldSandbox:
    """The shared sandbox, with each parse waiting until ``release`` is set (bounded)."""

    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner
        self.waiting = threading.Semaphore(0)
        self.release = threading.Event()

    def inspect(self, *args: object) -> object:
        self.waiting.release()
        self.release.wait(30)
        return self.inner.inspect(*args)  # type: ignore[arg-type]


def test_concurrent_uploads_per_hospital(client, site_token, tmp_path):
    """Probe: 42 concurrent uploads from one hospital delayed another hospital's by 39.9 s. Now a
    hospital has at most --site-concurrent-uploads (2) in progress; the next is 429 before its
    body is read, and another hospital's upload goes through."""
    ctx = client.app.state.admin
    held = _HeldSandbox(ctx.sandbox)
    ctx.sandbox = held
    a, b = site_token("hosp-a"), site_token("hosp-b")
    rnd = create_round(client)
    model = write_model(tmp_path / "m.h5", 1.0)
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(post_file, TestClient(client.app), rnd["id"], a, model) for _ in range(2)]
        try:
            for _ in running:
                assert held.waiting.acquire(timeout=30)
            third = post_file(client, rnd["id"], a, model)
            assert third.status_code == 429 and third.headers["connection"] == "close"
            assert "--site-concurrent-uploads" in third.json()["detail"]
            held.release.set()
            assert {f.result(timeout=60).status_code for f in running} == {201}
        finally:
            held.release.set()
    assert post_file(client, rnd["id"], b, model).status_code == 201
    assert post_file(client, rnd["id"], a, model).status_code == 201  # its slots are free again


# 12. Removal race -----------------------------------------------------------------------------------
def test_site_removed_during_its_upload_stores_nothing(client, site_token, data_dir, tmp_path):
    """Probe: an upload still being parsed when its hospital was removed was answered 201 and
    stored. The removal is now re-checked inside the upload's commit."""
    ctx = client.app.state.admin
    held = _HeldSandbox(ctx.sandbox)
    ctx.sandbox = held
    token = site_token("hosp-a")
    rnd = create_round(client)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(post_file, TestClient(client.app), rnd["id"], token,
                              write_model(tmp_path / "m.h5", 1.0))
        try:
            assert held.waiting.acquire(timeout=30)
            remove_site(data_dir=data_dir, name="hosp-a")
        finally:
            held.release.set()
        answer = running.result(timeout=60)
    assert answer.status_code == 401 and "was removed while its upload" in answer.json()["detail"]
    assert client.get(f"/api/v1/rounds/{rnd['id']}", headers=ADMIN).json()["uploads"] == []
    assert not (data_dir / "files" / "rounds" / str(rnd["id"]) / "uploads").exists() or not any(
        (data_dir / "files" / "rounds" / str(rnd["id"]) / "uploads").iterdir())


# 10. The audit chain was unkeyed ----------------------------------------------------------------------


def test_forged_appends_and_an_emptied_log_fail_verify(client, site_token, data_dir, capsys):
    """Probe: records appended with recomputed hashes passed `audit verify`, even with --head;
    deleting every record reported "intact: 0 record(s)", exit 0. Each record is now MAC'd
    (HMAC-SHA256) with a key outside the database, created 0600, whose head file names the last
    record it signed."""
    site_token("hosp-a")
    assert client.get("/api/v1/rounds", headers=ADMIN).status_code == 200
    code, out = verify_audit(data_dir, capsys)
    assert code == 0 and "intact" in out
    head = out.split("head ")[-1].strip()
    key = data_dir / "audit.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(str(key) + ".head").stat().st_mode) == 0o600
    forged = forge_audit_record(data_dir)
    for extra in ((), ("--head", head)):
        code, out = verify_audit(data_dir, capsys, *extra)
        assert code == 1 and f"record {forged} carries no MAC" in out, out
    with sqlite3.connect(data_dir / "fedsplit-admin.db") as db:
        db.execute("UPDATE audit_log SET mac = ? WHERE id = ?", ("ab" * 32, forged))
    code, out = verify_audit(data_dir, capsys)
    assert code == 1 and "carries a MAC this key did not make" in out
    with sqlite3.connect(data_dir / "fedsplit-admin.db") as db:
        db.execute("DELETE FROM audit_log")
    code, out = verify_audit(data_dir, capsys)
    assert code == 1 and "the log ends at record 0" in out and "deleted" in out


def test_rewritten_chain_and_loose_key_are_caught(client, site_token, data_dir, capsys):
    """Editing a record and recomputing every hash after it (what passed before) breaks the MACs;
    a log from before the key (no MACs) verifies as a prefix; a key others may read is refused."""
    site_token("hosp-a")
    site_token("hosp-b")
    with sqlite3.connect(data_dir / "fedsplit-admin.db") as db:
        rows = db.execute("SELECT id, at, event, actor, site_id, address, detail, prev_hash "
                          "FROM audit_log ORDER BY id").fetchall()
        previous = audit.GENESIS
        for number, row in enumerate(rows):
            fields = dict(zip(("id", "at", "event", "actor", "site_id", "address", "detail",
                               "prev_hash"), row, strict=True))
            fields["prev_hash"] = previous
            if number == 0:
                fields["actor"] = "someone else"
            previous = audit.record_hash(fields)
            db.execute("UPDATE audit_log SET actor = ?, prev_hash = ?, hash = ? WHERE id = ?",
                       (fields["actor"], fields["prev_hash"], previous, fields["id"]))
    code, out = verify_audit(data_dir, capsys)
    assert code == 1 and "record 1 carries a MAC this key did not make" in out
    fresh = data_dir.parent / "legacy"
    add_site(data_dir=fresh, name="hosp-a")
    add_site(data_dir=fresh, name="hosp-b")
    with sqlite3.connect(fresh / "fedsplit-admin.db") as db:  # as a server before issue 33 wrote it
        db.execute("UPDATE audit_log SET mac = NULL WHERE id = 1")
    code, out = verify_audit(fresh, capsys)
    assert code == 0 and "2 record(s) (1 written before the log had a key" in out
    (fresh / "audit.key").chmod(0o644)
    code, out = verify_audit(fresh, capsys)
    assert code != 0 and "chmod 600" in out


# 7. Isolation side channels -------------------------------------------------------------------------
def test_metrics_ids_and_participation_are_not_shown_to_hospitals(client, site_token, tmp_path):
    """Probes: /metrics needed no token (each upload's size, each refusal's reason, live); upload
    ids were global (gaps counted other hospitals' uploads); a fresh round's model_source turned
    to first_upload as soon as another hospital uploaded."""
    a, b = site_token("hosp-a"), site_token("hosp-b")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=bearer(a)).status_code == 403
    assert client.get("/metrics", headers=ADMIN).status_code == 200
    first, second = create_round(client), create_round(client)
    model = write_model(tmp_path / "m.h5", 1.0)
    assert post_file(client, first["id"], a, model).json()["id"] == 1
    for _ in range(3):
        assert post_file(client, second["id"], b, model).status_code == 201
    seen = client.get(f"/api/v1/rounds/{second['id']}", headers=bearer(a)).json()
    assert seen["model_source"] is None and seen["parameters"] is None and seen["uploads"] == []
    receipt = post_file(client, second["id"], a, model).json()
    assert receipt["id"] == 2 and receipt["replaced"] is None  # its own second upload: no gap
    seen = client.get(f"/api/v1/rounds/{second['id']}", headers=bearer(a)).json()
    assert seen["model_source"] == "first_upload" and seen["parameters"]
    mine = client.get(f"/api/v1/rounds/{second['id']}", headers=bearer(b)).json()
    assert [u["id"] for u in mine["uploads"]] == [3] and [u["id"] for u in mine["history"]] == [1, 2]


# 8. Valid tokens were locked out with their address ---------------------------------------------
def test_valid_tokens_are_served_during_an_address_wait(client, site_token, tmp_path):
    """Probe: after 6 wrong tokens from one address, a valid hospital upload and the admin's
    sign-in from that address both got 429. Only failures wait now."""
    a = site_token("hosp-a")
    rnd = create_round(client)
    wrong = [client.get("/api/v1/rounds", headers=bearer("wrong-token-0123456789")).status_code
             for _ in range(8)]
    assert wrong[:6] == [401] * 6 and wrong[6:] == [429, 429]
    assert post_file(client, rnd["id"], a, write_model(tmp_path / "m.h5")).status_code == 201
    assert client.get("/api/v1/rounds", headers=ADMIN).status_code == 200
    signed = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers=SAME_ORIGIN,
                         follow_redirects=False)
    assert signed.status_code == 303
    assert client.get("/api/v1/rounds", headers=bearer("wrong-token-0123456789")).status_code == 429


def test_requests_per_hospital_are_rate_limited(make_client, site_token):
    """--site-requests-per-minute: one hospital's flood is 429 after its burst; another hospital
    and the admin are served."""
    client = make_client(site_requests_per_minute=60)  # bursts of 12
    a, b = site_token("hosp-a"), site_token("hosp-b")
    statuses = [client.get("/api/v1/rounds", headers=bearer(a)).status_code for _ in range(14)]
    assert statuses[:12] == [200] * 12 and statuses[12:] == [429, 429]
    limited = client.get("/api/v1/rounds", headers=bearer(a))
    assert "--site-requests-per-minute" in limited.json()["detail"] and "retry-after" in limited.headers
    assert client.get("/api/v1/rounds", headers=bearer(b)).status_code == 200
    assert client.get("/api/v1/rounds", headers=ADMIN).status_code == 200


# 9. The audit log grew with every identical request ---------------------------------------------------
def test_repeated_identical_events_are_coalesced(make_client, site_token, data_dir, tmp_path):
    """Probe: 500 downloads wrote 500 records in 5 s. Identical events within a minute are now
    one record plus one count (200 downloads: 2 records)."""
    client = make_client(site_requests_per_minute=100_000)
    token = site_token("hosp-a")
    rnd = create_round(client)
    with open(write_model(tmp_path / "t.h5", 1.0), "rb") as fh:
        assert client.put(f"/api/v1/rounds/{rnd['id']}/template", files={"file": ("t.h5", fh)},
                          headers=ADMIN).status_code == 200
    for _ in range(200):  # the probe's 500, fewer: the same rule
        assert client.get(f"/api/v1/rounds/{rnd['id']}/start-model", headers=bearer(token)).status_code == 200
    ctx = client.app.state.admin
    ctx.audit.flush_noise()  # as at shutdown
    downloads = audit.query(ctx.engine, events=["model_download"], limit=1000)
    assert len(downloads) == 2
    assert audit.parse_detail(downloads[-1])["repeated"] == 199
    assert audit.verify(ctx.engine, ctx.audit.key).ok


# 6. One hospital's Keras attributes reached every other hospital ----------------------------------
def legacy_keras(path: Path, value: float, **extra_attrs: str) -> Path:
    """A legacy Keras ``save_weights("x.h5")`` file, written as Keras 3.15 writes one, plus
    ``extra_attrs`` at its root and on its layer (what a hospital's own tooling may add)."""
    with h5py.File(path, "w") as f:
        f.attrs["backend"] = "torch"
        f.attrs["keras_version"] = "3.15.1"
        f.attrs["layer_names"] = np.array(["dense"], dtype=h5py.string_dtype())
        layer = f.create_group("dense")
        layer.attrs["weight_names"] = np.array(["sequential/dense/kernel", "sequential/dense/bias"],
                                               dtype=h5py.string_dtype())
        layer["sequential/dense/kernel"] = np.full((4, 3), value, np.float32)
        layer["sequential/dense/bias"] = np.full((3,), value, np.float32)
        top = f.create_group("top_level_model_weights")
        top.attrs["weight_names"] = np.array([], dtype=np.float64)
        for key, text in extra_attrs.items():
            f.attrs[key] = text
            layer.attrs[key] = text
    return path


def _all_attrs(path: Path) -> str:
    found: list[str] = []
    with h5py.File(path) as f:
        found += [f"{k}={v!r}" for k, v in f.attrs.items()]
        f.visititems(lambda name, obj: found.extend(f"{name}:{k}={v!r}" for k, v in obj.attrs.items()))
    return "\n".join(found)


def test_keras_download_carries_no_other_hospitals_attributes(make_client, site_token, data_dir,
                                                               tmp_path):
    """Probe: a root attribute "hosp-b trained on ward 7 ..." from hosp-b's legacy Keras upload
    appeared in hosp-a's ?format=keras download, and a 48 MiB attribute upload, kept in the
    round's row, made every GET /rounds 4x slower. Now only Keras's own attributes are kept
    (layer and weight names, version, backend), beside the round's row."""
    client = make_client(max_upload_mb=8)
    a, b = site_token("hosp-a"), site_token("hosp-b")
    rnd = create_round(client)
    bulk = "x" * 900_000
    secret = "hosp-b trained on ward 7, patients 2019-2023"
    first = legacy_keras(tmp_path / "b.h5", 1.0, note=secret, bulk1=bulk, bulk2=bulk, bulk3=bulk)
    assert post_file(client, rnd["id"], b, first, num_examples=100).status_code == 201
    assert post_file(client, rnd["id"], a, legacy_keras(tmp_path / "a.h5", 3.0),
                     num_examples=100).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    download = client.get(f"/api/v1/rounds/{rnd['id']}/model?format=keras", headers=bearer(a))
    assert download.status_code == 200
    got = tmp_path / "got.h5"
    got.write_bytes(download.content)
    attrs = _all_attrs(got)
    assert "ward 7" not in attrs and "bulk" not in attrs and b"ward 7" not in download.content
    assert "layer_names" in attrs and "weight_names" in attrs and "keras_version" in attrs
    with h5py.File(got) as f:
        assert np.allclose(f["dense/sequential/dense/kernel"][()], 2.0)
    with sqlite3.connect(data_dir / "fedsplit-admin.db") as db:
        (row,) = db.execute("SELECT keras_layout FROM rounds WHERE id = ?", (rnd["id"],)).fetchone()
        (kept,) = db.execute("SELECT layout FROM round_keras_layouts WHERE round_id = ?",
                             (rnd["id"],)).fetchone()
    assert json.loads(row) == {"kind": "keras-legacy"} and len(kept) < 4096


# 11. A relative --data-dir refused every upload ------------------------------------------------------
def test_relative_data_dir_is_resolved_once(make_client, site_token, tmp_path, monkeypatch):
    """Probe: a relative --data-dir (docs/web-view.md shows one) refused every upload as
    parser_crash: the sandbox runs in another working directory. It is resolved once now."""
    monkeypatch.chdir(tmp_path)
    client = make_client(data_dir=Path("relative-data"))
    assert client.app.state.admin.settings.data_dir == (tmp_path / "relative-data").resolve()
    token = add_site(data_dir=Path("relative-data"), name="hosp-a")
    rnd = create_round(client)
    answer = post_file(client, rnd["id"], token, write_model(tmp_path / "m.h5", 1.0))
    assert answer.status_code == 201, answer.text


# 13. World-readable files -------------------------------------------------------------------------------
def test_stored_files_are_private_under_a_permissive_umask(make_client, site_token, data_dir, tmp_path):
    """Probe: raw uploads and the database were 0644 under umask 022. The data directory is
    0700 and what the server stores is 0600, whatever the umask."""
    old = os.umask(0o022)
    try:
        client = make_client()
        a, b = site_token("hosp-a"), site_token("hosp-b")
        rnd = create_round(client)
        for token, value in ((a, 1.0), (b, 2.0)):
            assert post_file(client, rnd["id"], token, write_model(tmp_path / f"{value}.h5", value)
                             ).status_code == 201
        assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    finally:
        os.umask(old)
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    stored = [p for p in data_dir.rglob("*") if p.is_file()]
    assert any(p.parent.name == "uploads" for p in stored) and any(p.name == "model.h5" for p in stored)
    loose = {str(p.relative_to(data_dir)): oct(stat.S_IMODE(p.stat().st_mode)) for p in stored
             if stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert loose == {}


# Also: reserved and case-folded site names; a count of 2^64-1 ----------------------------------------
def test_site_names_are_reserved_and_case_folded(data_dir):
    """Probe: a site could be named `unauthenticated` (the audit log's own actor) or `HOSP-A`
    beside `hosp-a`."""
    add_site(data_dir=data_dir, name="hosp-a")
    for name, words in (("unauthenticated", "is reserved"), ("HOSP-A", "differ only in case")):
        try:
            add_site(data_dir=data_dir, name=name)
        except ConfigError as e:
            assert words in str(e)
        else:
            raise AssertionError(f"{name} was registered")


def test_huge_file_count_is_refused_as_a_count(client, site_token, tmp_path):
    """Probe: a file count of 2^64-1 was refused as parser_crash (an overflow while writing the
    canonical copy) instead of num_examples."""
    token = site_token("hosp-a")
    rnd = create_round(client)
    path = raw_weights(tmp_path / "huge.h5", lambda f, g: g.create_dataset("w", data=np.ones(3, np.float32)),
                       num_examples=np.uint64(2**64 - 1))
    answer = post_file(client, rnd["id"], token, path)
    assert answer.status_code == 422 and answer.json()["reason"] == "num_examples"
    assert "18446744073709551615" in answer.json()["detail"]


# 1. Forwarded addresses: trusted only from named proxies -------------------------------------------
def test_named_proxy_is_trusted(client):
    """With --forwarded-allow-ips 127.0.0.1 (nginx on the same host setting X-Forwarded-For
    $remote_addr), uvicorn's own middleware, as `admin serve` configures it, gives each client its
    own failure count and audited address; from any other sender the header is ignored. (Without
    the option `admin serve` turns it off: test_trust_live.py, on a real server.)"""
    settings = forwarded_settings(["127.0.0.1"])
    assert forwarded_settings(None) == {"proxy_headers": False, "forwarded_allow_ips": ""}
    proxied = ProxyHeadersMiddleware(client.app, trusted_hosts=settings["forwarded_allow_ips"])
    wrong = {"host": "testserver", "authorization": "Bearer wrong-token-0123456789"}

    def status(address: str, sender: str = "127.0.0.1") -> int:
        return call(proxied, "GET", "/api/v1/rounds", {**wrong, "x-forwarded-for": address},
                    client=sender).status

    assert [status("198.51.100.1") for _ in range(7)] == [401] * 6 + [429]
    assert status("198.51.100.2") == 401  # another client behind the proxy: its own count
    assert status("198.51.100.3", sender="203.0.113.5") == 401  # not a named proxy: header ignored
    ctx = client.app.state.admin
    addresses = {r.address for r in audit.query(ctx.engine, events=["signin_failed"], limit=100)}
    assert addresses == {"198.51.100.1", "198.51.100.2", "203.0.113.5"}
