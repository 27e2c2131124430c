"""Every refusal class: status, exact detail, metric reason, and nothing stored."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from httpx import Response

from tests._helpers.weight_files import raw_weights
from tests.admin.conftest import ADMIN, bearer, create_round, post_file, write_model

W = np.ones((3, 4), dtype=np.float32)


def _soft_link(f: h5py.File, g: h5py.Group) -> None:
    g["w"] = W
    g["alias"] = h5py.SoftLink("/arrays/w")


def _external_link(f: h5py.File, g: h5py.Group) -> None:
    g["w"] = W
    g["secret"] = h5py.ExternalLink("/etc/hostname", "/")


def _external_storage(f: h5py.File, g: h5py.Group) -> None:
    raw = Path(f.filename).with_suffix(".raw")
    raw.write_bytes(W.tobytes())
    g.create_dataset("w", shape=(3, 4), dtype="<f4", external=[(str(raw), 0, W.nbytes)])


def _virtual(f: h5py.File, g: h5py.Group) -> None:
    src = Path(f.filename).with_suffix(".src.h5")
    with h5py.File(src, "w") as s:
        s["data"] = W
    layout = h5py.VirtualLayout(shape=(3, 4), dtype="f4")
    layout[:] = h5py.VirtualSource(str(src), "data", shape=(3, 4))
    g.create_virtual_dataset("w", layout)


def _nested(f: h5py.File, g: h5py.Group) -> None:
    g.create_group("sub")["w"] = W


def _deep(f: h5py.File, g: h5py.Group) -> None:
    node = g
    for i in range(14):
        node = node.create_group(f"g{i}")
    node["w"] = W


def _nan(f: h5py.File, g: h5py.Group) -> None:
    bad = W.copy()
    bad[1, 2] = np.nan
    g["w"] = bad


def _scaleoffset(f: h5py.File, g: h5py.Group) -> None:
    g.create_dataset("w", data=W, scaleoffset=2)


def _compound(f: h5py.File, g: h5py.Group) -> None:
    g["w"] = np.zeros(3, dtype=[("a", "f4"), ("b", "i4")])


def _strings(f: h5py.File, g: h5py.Group) -> None:
    g.create_dataset("w", data=np.array(["x", "y"], dtype=h5py.string_dtype()))


def _integers(f: h5py.File, g: h5py.Group) -> None:
    g["w"] = np.ones(3, dtype=np.int64)


def _shape_bomb(f: h5py.File, g: h5py.Group) -> None:
    g.create_dataset("w", shape=(10**9,), chunks=(1024,), dtype="f4")  # no data written: tiny file


U = "The uploaded file"
CASES: list[tuple[str, Callable[[h5py.File, h5py.Group], None], str, str]] = [
    (
        "soft link", _soft_link, "link",
        f"{U}: /arrays/alias is a soft link; weight files may not contain soft, external or "
        "user-defined links (they can point into other files). Save the weights without links. "
        "Received: /arrays/alias -> /arrays/w",
    ),
    (
        "external link", _external_link, "link",
        f"{U}: /arrays/secret is an external link; weight files may not contain soft, external or "
        "user-defined links (they can point into other files). Save the weights without links. "
        "Received: /arrays/secret -> /etc/hostname:/",
    ),
    (
        "virtual dataset", _virtual, "virtual_dataset",
        f"{U}: /arrays/w is a virtual dataset (it maps data from other files). Write the values into "
        "the file itself. Received: /arrays/w",
    ),
    (
        "nested group", _nested, "nested_group",
        "Weight file <uploaded file>: /arrays/sub is a group; nested groups are not allowed in "
        "/arrays (flatten names as 'layer.0.weight'). Received: /arrays/sub",
    ),
    (
        "deep tree", _deep, "too_deep",
        f"{U} nests groups deeper than 12 levels at /arrays/g0/g1/g2/g3/g4/g5/g6/g7/g8/g9/g10/g11/; "
        "weight files are shallow (fedsplit: /arrays/NAME, Keras: layers/NAME/vars/N). Received: "
        "depth > 12",
    ),
    (
        "NaN", _nan, "non_finite",
        "Parameter 'w' in the Weight file <uploaded file> holds 1 NaN/Inf value(s); a diverged or "
        "corrupted update cannot be aggregated. Retrain with a lower learning rate or check the "
        "site's data. Received: 1 non-finite of 12",
    ),
    (
        "plugin filter", _scaleoffset, "filter",
        f"{U}: /arrays/w uses HDF5 filter 6; only gzip, shuffle, fletcher32 are accepted (any other "
        "filter needs a plugin library loaded at read time). Save without compression or with gzip. "
        "Received: filter 6",
    ),
    (
        "compound dtype", _compound, "dtype",
        f"{U}: /arrays/w has dtype {np.dtype([('a', 'f4'), ('b', 'i4')])} (compound); weight files "
        "hold numeric arrays only, parameters float16/32/64. Received: dtype="
        f"{np.dtype([('a', 'f4'), ('b', 'i4')])}",
    ),
    (
        "string dtype", _strings, "dtype",
        f"{U}: /arrays/w has dtype object (string); weight files hold numeric arrays only, parameters "
        "float16/32/64. Received: dtype=object",
    ),
    (
        "integer parameter", _integers, "dtype",
        "Weight file <uploaded file>: /arrays/w has dtype int64; parameters must be float16, float32 "
        "or float64. Received: dtype=int64",
    ),
    (
        "shape bomb", _shape_bomb, "too_large",
        f"{U}: /arrays/w declares shape (1000000000,) (1000000000 values), more than the 524288 "
        "values this round accepts (its model's size or the upload limit). Upload the round's "
        "model. Received: shape (1000000000,)",
    ),
]


def assert_nothing_stored(client, data_dir: Path, round_id: int) -> None:
    """No upload row, no stored file, no temp file left."""
    assert client.get(f"/api/v1/rounds/{round_id}", headers=ADMIN).json()["uploads"] == []
    assert not (data_dir / "files" / "rounds" / str(round_id) / "uploads").exists()
    assert list((data_dir / "files" / "tmp").iterdir()) == []


@pytest.fixture
def refused(client, site_token, data_dir) -> Callable[..., Response]:
    """Uploads a file as hospital-a to a new round, asserts it is refused with ``status`` and
    nothing is stored, and returns the response."""

    def upload(path: Path, *, status: int = 422, cohort_size: int | None = None,
               num_examples: int | str | None = None) -> Response:
        token = site_token("hospital-a", cohort_size=cohort_size)
        rnd = create_round(client)
        response = post_file(client, rnd["id"], token, path, num_examples=num_examples)
        assert response.status_code == status, response.text
        assert_nothing_stored(client, data_dir, rnd["id"])
        return response

    return upload


@pytest.mark.parametrize(("label", "build", "reason", "detail"), CASES, ids=[c[0] for c in CASES])
def test_unsafe_or_invalid_file_is_refused(
    client, site_token, data_dir, tmp_path, label, build, reason, detail
):
    """Refused with 422 naming problem and fix; nothing stored; the server keeps serving."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    path = raw_weights(tmp_path / "bad.h5", build)
    response = post_file(client, rnd["id"], token, path)
    assert response.status_code == 422
    assert response.json() == {"detail": detail, "error": "UploadRefusedError", "reason": reason}
    assert_nothing_stored(client, data_dir, rnd["id"])
    metrics = client.get("/metrics", headers=ADMIN).text
    assert f'fedsplit_uploads_refused_total{{reason="{reason}"}} 1' in metrics
    assert post_file(client, rnd["id"], token, write_model(tmp_path / "ok.h5")).status_code == 201


def test_external_storage_is_refused(refused, tmp_path):
    """External raw storage would read another file of the server's: refused before any read."""
    response = refused(raw_weights(tmp_path / "bad.h5", _external_storage))
    assert response.json()["reason"] == "external_storage"
    assert response.json()["detail"] == (
        f"{U}: /arrays/w uses external raw storage (its bytes live in another file). Write the values "
        f"into the file itself. Received: external={[str(tmp_path / 'bad.raw')]!r}"
    )


def test_not_hdf5_is_refused(refused, tmp_path):
    """Bytes without the HDF5 signature."""
    path = tmp_path / "model.h5"
    path.write_bytes(b"PK\x03\x04 this is a zip, not HDF5")
    assert refused(path).json()["detail"] == (
        "The uploaded file is not HDF5 (no HDF5 signature). Upload a fedsplit weight file (`fedsplit "
        "export CHECKPOINT.pt --num-examples N -o FILE.h5`) or a Keras save_weights file. Received: "
        "28 bytes starting b'PK\\x03\\x04 thi'"
    )


def test_truncated_file_is_refused(refused, tmp_path):
    """A file cut short is refused as truncated or corrupt."""
    good = write_model(tmp_path / "good.h5")
    path = tmp_path / "cut.h5"
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    body = refused(path).json()
    assert body["reason"] == "corrupt"
    assert body["detail"].startswith("The uploaded file ")
    assert "truncated or corrupt" in body["detail"]
    assert body["detail"].endswith(("Received: 4138 bytes", "Received: OSError"))


def test_hdf5_of_another_format_is_refused(refused, tmp_path):
    """HDF5 that is neither a fedsplit nor a Keras weights file."""
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["data"] = W
    assert refused(path).json()["detail"] == (
        "The uploaded file is HDF5 but neither a fedsplit weight file (root attribute "
        "format='fedsplit.weights') nor a Keras weights file (layers/... or layer_names). Write one "
        "with `fedsplit export CHECKPOINT.pt --num-examples N -o FILE.h5` or Keras's "
        "model.save_weights('x.weights.h5'). Received: root entries ['data']"
    )


def test_upload_over_the_size_limit_is_refused_with_413(refused, tmp_path):
    """A declared body over the limit is refused before it is read."""
    path = tmp_path / "big.h5"
    path.write_bytes(b"\0" * (1024 * 1024 + 70 * 1024))
    response = refused(path, status=413)
    declared = response.request.headers["content-length"]
    assert response.json()["detail"] == (
        "The upload is larger than this server's limit of 1048576 bytes (1 MiB). Upload the round's "
        "model only (no optimizer state), or ask the coordinator to raise --max-upload-mb. "
        f"Received: Content-Length {declared}"
    )


def test_streamed_upload_over_the_size_limit_stops_at_the_limit(client, site_token, data_dir):
    """Without Content-Length the limit is enforced as bytes arrive; the temp file is removed."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    sent = []

    def body():
        yield b'--B\r\nContent-Disposition: form-data; name="file"; filename="x.h5"\r\n\r\n'
        for _ in range(64):  # 4 MiB in 64 KiB chunks, far over the 1 MiB limit
            sent.append(1)
            yield b"\0" * 65536
        yield b"\r\n--B--\r\n"

    response = client.post(
        f"/api/v1/rounds/{rnd['id']}/uploads",
        content=body(),
        headers={**bearer(token), "Content-Type": "multipart/form-data; boundary=B"},
    )
    assert response.status_code == 413
    assert response.json()["detail"] == (
        "The upload is larger than this server's limit of 1048576 bytes (1 MiB). Upload the round's "
        "model only (no optimizer state), or ask the coordinator to raise --max-upload-mb. "
        "Received: more than 1048576 bytes of file data"
    )
    assert_nothing_stored(client, data_dir, rnd["id"])


def test_upload_not_matching_the_round_model_names_the_first_difference(client, site_token, tmp_path):
    """The first accepted upload fixes the model; a different shape is refused."""
    a, b = site_token("hospital-a"), site_token("hospital-b")
    rnd = create_round(client)
    assert post_file(client, rnd["id"], a, write_model(tmp_path / "a.h5")).status_code == 201
    response = post_file(client, rnd["id"], b, write_model(tmp_path / "b.h5", hidden=5))
    assert response.status_code == 422
    assert response.json() == {
        "detail": (
            "Parameter 'layer.0.weight' has shape (3, 4) (float32) in the round's model but "
            "(5, 4) (float32) in the upload. Every site must train the round's model from its "
            "start model (GET /api/v1/rounds/{id}/start-model). Received: parameters "
            "['layer.0.weight', 'layer.0.bias', 'layer.1.weight']"
        ),
        "error": "UploadRefusedError",
        "reason": "model_mismatch",
    }
    uploads = client.get(f"/api/v1/rounds/{rnd['id']}", headers=ADMIN).json()["uploads"]
    assert [u["site"] for u in uploads] == ["hospital-a"]


def test_dataset_larger_than_the_round_model_is_refused_before_reading(client, site_token, tmp_path):
    """Once the model is fixed, a declared size above it is refused from metadata alone."""
    a, b = site_token("hospital-a"), site_token("hospital-b")
    rnd = create_round(client)
    assert post_file(client, rnd["id"], a, write_model(tmp_path / "a.h5")).status_code == 201
    response = post_file(client, rnd["id"], b, raw_weights(tmp_path / "bomb.h5", _shape_bomb))
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "The uploaded file: /arrays/w declares shape (1000000000,) (1000000000 values), more than the "
        "21 values this round accepts (its model's size or the upload limit). Upload the round's "
        "model. Received: shape (1000000000,)"
    )


@pytest.mark.parametrize(
    ("form", "file_count", "detail"),
    [
        (
            None, None,
            "The upload carries no sample count: the file has no 'num_examples' attribute and the "
            "form has no num_examples field. FedAvg weights every upload by its count; send the "
            "number of training rows (`fedsplit upload ... --num-examples 1200`, or form field "
            "num_examples). Received: no count",
        ),
        (
            "12.5", None,
            "Form field num_examples must be an integer >= 1: the number of training rows behind these "
            "weights (FedAvg's weight). Received: '12.5'",
        ),
        (
            "0", None,
            "Form field num_examples must be an integer >= 1: the number of training rows behind these "
            "weights (FedAvg's weight). Received: '0'",
        ),
        (
            "501", None,
            "num_examples 501 is above site 'hospital-a''s registered cohort size 500; a site cannot "
            "train on more rows than it has. Send the real count, or ask the coordinator to register "
            "the site with the right --cohort-size. Received: 501",
        ),
        (
            None, 501,
            "num_examples 501 is above site 'hospital-a''s registered cohort size 500; a site cannot "
            "train on more rows than it has. Send the real count, or ask the coordinator to register "
            "the site with the right --cohort-size. Received: 501",
        ),
        (
            None, 0,
            "Weight file <uploaded file>: root attribute 'num_examples' must be an integer >= 1 (the "
            "number of training rows behind these weights). Received: 0.0",
        ),
    ],
)
def test_bad_sample_counts_are_refused(refused, tmp_path, form, file_count, detail):
    """Missing, non-integer, < 1 and above-cohort counts are refused."""
    attrs = {"num_examples": None if file_count is None else np.int64(file_count)}
    if file_count == 0:
        attrs["num_examples"] = np.float64(0.0)
    path = raw_weights(tmp_path / "m.h5", lambda f, g: g.__setitem__("w", W), **attrs)
    response = refused(path, cohort_size=500, num_examples=form)
    assert response.json()["detail"] == detail
    assert response.json()["reason"] == "num_examples"


def test_absurd_count_is_refused(refused, tmp_path):
    """A count over 10^9 is refused even for a site without a registered cohort size."""
    response = refused(write_model(tmp_path / "m.h5"), num_examples=10**9 + 1)
    assert response.json()["detail"] == (
        "num_examples 1000000001 is over 1000000000, which no hospital cohort reaches; it would swamp "
        "every other site in the average. Send the number of training rows. Received: 1000000001"
    )
