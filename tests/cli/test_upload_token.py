"""`fedsplit upload` reads the site token from --token-file or $FEDSPLIT_SITE_TOKEN, never argv."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fedsplit.cli.upload import upload
from fedsplit.orchestration.flower_runtime import free_port
from fedsplit.orchestration.upload_client import TOKEN_ENV, read_token, upload_file
from fedsplit.protocol.errors import ConfigError, UploadFailedError


def test_token_file_is_read_and_stripped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  fss_abc\n")
    assert read_token(path, {TOKEN_ENV: "fss_env"}) == "fss_abc"  # the file wins


def test_environment_variable_is_read_and_stripped() -> None:
    assert read_token(None, {TOKEN_ENV: " fss_env\n"}) == "fss_env"


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ("missing", r"does not exist.*Received: .*nope"),
        ("empty", r"is empty.*Received: 3 byte\(s\) of whitespace"),
        ("directory", r"cannot be read \(IsADirectoryError"),
        ("binary", r"cannot be read \(UnicodeDecodeError"),
    ],
)
def test_bad_token_files_are_named(tmp_path: Path, setup: str, match: str) -> None:
    path = {"missing": tmp_path / "nope", "directory": tmp_path}.get(setup, tmp_path / "t")
    if setup == "empty":
        path.write_text(" \n\t")
    if setup == "binary":
        path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=match):
        read_token(path, {})


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_token_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("fss_abc")
    path.chmod(0)
    with pytest.raises(ConfigError, match=r"cannot be read \(PermissionError"):
        read_token(path, {})


def test_no_token_or_an_empty_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"No site token.*Received: neither"):
        read_token(None, {})
    with pytest.raises(ConfigError, match=r"set but empty.*Received: FEDSPLIT_SITE_TOKEN=' '"):
        read_token(None, {TOKEN_ENV: " "})


def test_upload_has_no_token_argument() -> None:
    """A secret is never an argument: the command takes no --token option."""
    assert "token" not in upload.__annotations__
    assert "token_file" in upload.__annotations__


def test_the_client_refuses_a_missing_file_and_names_an_unreachable_server(tmp_path: Path) -> None:
    """The upload client (the CLI's `upload` only parses, calls and prints)."""
    with pytest.raises(UploadFailedError, match="does not exist or is not a file"):
        upload_file(tmp_path / "none.h5", "http://127.0.0.1:9", 1, token="fss_x")
    model = tmp_path / "m.h5"
    model.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(UploadFailedError, match=r"Could not upload to .*/api/v1/rounds/7/uploads.*"
                                                r"Check --server"):
        upload_file(model, url, 7, token="fss_x", timeout=5)
