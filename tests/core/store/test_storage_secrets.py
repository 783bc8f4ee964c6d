"""Storage holds no secret: literal credentials are refused, `{env: NAME}` references are resolved
by the process that opens the store, and what a Ray task receives (a pickled Storage or Lance
options) carries the variable's name, never its value."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from prx_core.store.credentials import (
    MissingCredentialError,
    SecretInConfigError,
    find_literal_secrets,
    redact,
    secret_like,
)
from prx_core.store.storage import Storage, filesystem_for, lance_storage_options

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
REFS = {"key": {"env": "PRX_T_KEY"}, "secret": {"env": "PRX_T_SECRET"},
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}}


@pytest.mark.parametrize("name", ["key", "secret", "token", "aws_secret_access_key", "aws_session_token",
                                  "password", "account_key", "sas_token", "HF_TOKEN", "clientSecret", "credentials"])
def test_secret_like_names(name: str) -> None:
    assert secret_like(name)


@pytest.mark.parametrize("name", ["endpoint_url", "region_name", "client_kwargs", "api_key_env", "max_tokens",
                                  "max_new_tokens", "tokenizer_revision", "anon", "use_ssl", "profile", "monkey",
                                  "signature_version", "requester_pays"])
def test_names_that_are_not_secrets(name: str) -> None:
    assert not secret_like(name)


def test_literal_secrets_are_found_at_any_depth_and_references_are_not() -> None:
    options = {"key": "AKIA", "secret": {"env": "S"}, "token": None, "anon": False,
               "client_kwargs": {"aws_session_token": "tok", "endpoint_url": "https://u:pw@minio:9000"},
               "config_kwargs": {"retries": {"max_attempts": 3}}, "credentials": {"value": "x"},
               "runtime_env": {"env_vars": {"HF_TOKEN": "hf", "HF_HUB_OFFLINE": "1"}}}
    assert find_literal_secrets(options) == ["key", "client_kwargs.aws_session_token", "client_kwargs.endpoint_url",
                                             "credentials.value", "runtime_env.env_vars.HF_TOKEN"]
    assert redact(options)["key"] == "***" and redact(options)["secret"] == {"env": "S"}
    assert redact(options)["client_kwargs"]["endpoint_url"] == "https://u:***@minio:9000"


def test_storage_refuses_a_literal_secret_and_names_the_fix() -> None:
    with pytest.raises(SecretInConfigError) as refused:
        Storage("s3://bucket/corpus", {"key": "AKIAEXAMPLE", "secret": SECRET})
    message = str(refused.value)
    assert "key, secret hold secret values" in message and "AWS_ACCESS_KEY_ID" in message and "{env: " in message
    assert SECRET not in message
    Storage("s3://bucket/corpus", {"client_kwargs": {"endpoint_url": "http://minio:9000"}})  # no secret: fine


def test_references_resolve_in_this_process_and_pickle_as_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRX_T_KEY", "AKIAPRXTEST")
    monkeypatch.setenv("PRX_T_SECRET", SECRET)
    storage = Storage("s3://bucket/corpus", REFS)
    options = storage.lance_storage_options()
    assert options["aws_access_key_id"] == "AKIAPRXTEST" and options["aws_secret_access_key"] == SECRET
    assert options["aws_endpoint"] == "http://127.0.0.1:9" and options["allow_http"] == "true"
    fs = storage.filesystem()
    assert fs.key == "AKIAPRXTEST" and fs.secret == SECRET  # s3fs built with the resolved values
    assert SECRET not in repr(options) and SECRET not in repr(storage)
    for value in (storage, options, {"args": (storage, options)}):
        blob = cloudpickle.dumps(value)
        assert SECRET.encode() not in blob and b"PRX_T_SECRET" in blob
    # a worker resolves from ITS environment when it unpickles
    monkeypatch.setenv("PRX_T_SECRET", "the-worker-secret")
    assert pickle.loads(cloudpickle.dumps(options))["aws_secret_access_key"] == "the-worker-secret"
    assert pickle.loads(cloudpickle.dumps(storage)).lance_storage_options()["aws_secret_access_key"] == \
        "the-worker-secret"


def test_a_missing_variable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRX_T_KEY", raising=False)
    monkeypatch.delenv("PRX_T_SECRET", raising=False)
    storage = Storage("s3://bucket/corpus", REFS)  # building is fine: nothing is resolved yet
    with pytest.raises(MissingCredentialError, match="storage option key refers to the environment variable "
                                                     "PRX_T_KEY, which is not set in this process"):
        storage.lance_storage_options()
    with pytest.raises(MissingCredentialError, match="PRX_T_KEY"):
        filesystem_for("s3://bucket/corpus", REFS)


def test_without_credentials_in_the_options_nothing_is_added() -> None:
    """The default chain: s3fs and Lance read AWS_* / a profile / an IAM role themselves."""
    options = lance_storage_options({"client_kwargs": {"endpoint_url": "https://s3.example", "region_name": "eu"}})
    assert dict(options) == {"aws_endpoint": "https://s3.example", "aws_region": "eu"}
