"""Object-store repository URLs, Triton's credential file and object keys that would
leave their model folder."""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import pytest

from dlserve.engine.cloud_stores import S3Location, azure_account, credential_entry, credentials_for
from dlserve.engine.object_store import model_file
from dlserve.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("url", "endpoint", "bucket", "prefix"),
    [
        ("s3://bucket", None, "bucket", ""),
        ("s3://bucket/", None, "bucket", ""),
        ("s3://bucket/path/to/repo", None, "bucket", "path/to/repo/"),
        ("s3://bucket//path///repo/", None, "bucket", "path/repo/"),
        ("s3://minio.local:9000/bucket/repo", "http://minio.local:9000", "bucket", "repo/"),
        ("s3://http://10.0.0.1:9000/bucket", "http://10.0.0.1:9000", "bucket", ""),
        (
            "s3://https://store.example.com:443/b/models",
            "https://store.example.com:443",
            "b",
            "models/",
        ),
    ],
)
def test_urls_in_tritons_forms(url: str, endpoint: str | None, bucket: str, prefix: str) -> None:
    location = S3Location.parse(url)
    assert (location.endpoint, location.bucket, location.prefix) == (endpoint, bucket, prefix)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://", "no bucket name"),
        ("s3://host:9000/", "no bucket name"),
        ("s3://https://store.example.com/bucket", "needs a port"),
    ],
)
def test_bad_urls_are_refused_by_name(url: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        S3Location.parse(url)
    assert url in caught.value.message


def test_the_longest_matching_credential_wins(tmp_path) -> None:
    path = tmp_path / "cloud_credential.json"
    path.write_text(
        json.dumps(
            {
                "s3": {
                    "": {"key_id": "DEFAULT", "secret_key": "d", "region": "eu-west-1"},
                    "s3://bucket-2": {"key_id": "TWO", "secret_key": "t", "session_token": "tok"},
                    "s3://bucket-2/special": {"profile": "special"},
                }
            }
        )
    )
    environ = {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)}
    assert credentials_for("s3://other/repo", environ) == {
        "aws_access_key_id": "DEFAULT",
        "aws_secret_access_key": "d",
        "region_name": "eu-west-1",
    }
    assert credentials_for("s3://bucket-2/models", environ) == {
        "aws_access_key_id": "TWO",
        "aws_secret_access_key": "t",
        "aws_session_token": "tok",
    }
    assert credentials_for("s3://bucket-2/special/models", environ) == {"profile_name": "special"}
    # No file named: boto3's own chain (environment, profile, ~/.aws, roles).
    assert credentials_for("s3://bucket-2/models", {}) == {}


def test_an_unreadable_credential_file_is_named(tmp_path) -> None:
    path = tmp_path / "creds.json"
    path.write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="cloud credential file"):
        credentials_for("s3://b", {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)})


def test_object_keys_that_leave_their_model_folder_are_never_files() -> None:
    assert model_file("add_sub", "1/model.py") == PurePosixPath("add_sub/1/model.py")
    for inside in ("../../etc/passwd", "1/../../x", "./config.pbtxt", "1//model.py", ""):
        assert model_file("add_sub", inside) is None, inside
    for model in ("", ".hidden", "..", "."):
        assert model_file(model, "config.pbtxt") is None, model


def test_a_credential_entry_that_is_not_an_object_is_named(tmp_path) -> None:
    path = tmp_path / "creds.json"
    path.write_text(json.dumps({"s3": {"s3://bucket": "AKIA..."}}))
    with pytest.raises(InvalidArgumentError, match="s3 entry for 's3://bucket/models' is not an object"):
        credentials_for("s3://bucket/models", {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)})


def test_a_gcs_credential_is_the_key_file_of_the_longest_match(tmp_path) -> None:
    path = tmp_path / "cloud_credential.json"
    path.write_text(json.dumps({"gs": {"": "/keys/default.json", "gs://bucket-2": "/keys/two.json"}}))
    environ = {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)}
    assert credential_entry("gs://bucket-2/models", "gs", environ) == "/keys/two.json"
    assert credential_entry("gs://other/models", "gs", environ) == "/keys/default.json"
    assert credential_entry("gs://other/models", "gs", {}) is None


def test_an_azure_account_is_found_where_triton_finds_it(tmp_path) -> None:
    url = "as://acct.blob.core.windows.net/models/repo"
    assert azure_account(url, {}) == ("acct", None, "models", "repo/")
    environment = {"AZURE_STORAGE_ACCOUNT": "fromenv", "AZURE_STORAGE_KEY": "k1"}
    assert azure_account(url, environment) == ("fromenv", "k1", "models", "repo/")
    path = tmp_path / "creds.json"
    path.write_text(json.dumps({"as": {"as://acct": {"account_str": "fromfile", "account_key": "k2"}}}))
    environment["TRITON_CLOUD_CREDENTIAL_PATH"] = str(path)
    assert azure_account(url, environment) == ("fromfile", "k2", "models", "repo/")
    with pytest.raises(InvalidArgumentError, match="name the account and the container"):
        azure_account("as://acct", {})


def test_the_credential_files_gcs_key_is_the_one_used(tmp_path, monkeypatch) -> None:
    """The "gs" entry names the key file the client is made from (here a broken one,
    which the error names) rather than the machine's default credentials."""
    pytest.importorskip("google.cloud.storage")
    from dlserve.engine.cloud_stores import GcsStore

    key = tmp_path / "key.json"
    key.write_text(json.dumps({"type": "service_account", "client_email": "x@y"}))
    credentials = tmp_path / "cloud_credential.json"
    credentials.write_text(json.dumps({"gs": {"gs://bucket": str(key)}}))
    monkeypatch.setenv("TRITON_CLOUD_CREDENTIAL_PATH", str(credentials))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    with pytest.raises(InvalidArgumentError, match="model repository 'gs://bucket/models'") as caught:
        GcsStore("gs://bucket/models")
    assert "private_key" in caught.value.message or "missing fields" in caught.value.message
