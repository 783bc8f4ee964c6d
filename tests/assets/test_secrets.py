"""Issue 15, item 4: a secret given to the configuration the supported way (an environment variable
the storage options refer to) is used by every process and persisted nowhere: not in Dagster's run
records, job or execution-plan snapshots, event log, materialization metadata or instance files;
not in any Ray task argument; not in any explorer page. A literal secret in PRX_CONFIG is refused."""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import cloudpickle
import dagster as dg
import pytest
import ray
import ray.actor
import ray.remote_function
import yaml
from demo_corpus import image_folder_source
from materializing import make_settings
from dagster._serdes import serialize_value
from starlette.testclient import TestClient

from prx_cli.build import run_build
from prx_assets.common import sync_partitions
from prx_assets.definitions import build_definitions
from prx_assets.settings import SettingsError, load_settings
from prx_core.sources.catalog import load_catalog
from prx_core.store import lance_io
from prx_core.store.storage import Storage
from prx_explorer.app import create_app
from prx_resources.explorer import ExplorerResource
from prx_resources.storage import StorageResource

# Set when pytest imports this module, i.e. before any test starts Ray: the session's Ray workers
# inherit them, as the pods of a real cluster get theirs from a secretKeyRef.
KEY_VAR, SECRET_VAR = "PRX_TEST_S3_KEY_ID", "PRX_TEST_S3_SECRET"
os.environ.setdefault(KEY_VAR, "AKIAPRX" + uuid.uuid4().hex[:13].upper())
os.environ.setdefault(SECRET_VAR, "prx-s3-secret-" + uuid.uuid4().hex)
SOURCE = "secret_photos"
# every stage that runs Ray tasks over the store; the model stages (caption labels and embeddings,
# then skip_lists) add minutes of model loading and no new way for options to travel
SELECT = ["raw_source", "samples", "buckets", "phashes", "captions", "mds_shards", "duplicates", "explorer"]


class ArgumentPickler(cloudpickle.CloudPickler):
    """cloudpickle, with the Ray handles an argument may hold kept out (Ray sends them by id)."""

    def persistent_id(self, obj: Any) -> str | None:
        return "ray-handle" if isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle)) else None


def pickled(value: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    ArgumentPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


@pytest.fixture
def ray_arguments(ray_session, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """What the driver pickles for Ray: every task's and actor call's arguments, every remote
    function (its closure included) and every `ray.put`, recorded while the test runs."""
    recorded: list[bytes] = []

    def wrap(owner: Any, name: str, with_function: bool = False) -> None:
        original = getattr(owner, name)

        def recording(self: Any, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
            recorded.append(pickled((args, kwargs, options.get("runtime_env"))))
            if with_function:
                recorded.append(pickled(self._function))
            return original(self, args, kwargs, *rest, **options)

        monkeypatch.setattr(owner, name, recording)

    wrap(ray.remote_function.RemoteFunction, "_remote", with_function=True)
    wrap(ray.actor.ActorClass, "_remote")
    wrap(ray.actor.ActorMethod, "_remote")
    put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, *a, **k: (recorded.append(pickled(value)), put(value, *a, **k))[1])
    yield recorded


def s3_options(endpoint: str) -> dict[str, Any]:
    """Storage options as a user writes them in PRX_CONFIG: references, no secret values."""
    return {"key": {"env": KEY_VAR}, "secret": {"env": SECRET_VAR},
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def upload(folder: Path, bucket: str, prefix: str, client: Any) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


def instance_texts(instance: dg.DagsterInstance) -> dict[str, str]:
    """Everything the instance stores about its runs, serialized as it is stored."""
    texts: dict[str, str] = {}
    for run in instance.get_runs():
        texts[f"run {run.run_id}"] = serialize_value(run)
        texts[f"run_config {run.run_id}"] = repr(run.run_config)
        texts[f"job snapshot {run.run_id}"] = serialize_value(instance.get_job_snapshot(run.job_snapshot_id))
        texts[f"plan snapshot {run.run_id}"] = serialize_value(
            instance.get_execution_plan_snapshot(run.execution_plan_snapshot_id))
        texts[f"event log {run.run_id}"] = "\n".join(serialize_value(e) for e in instance.all_logs(run.run_id))
    return texts


def test_a_secret_from_the_environment_is_persisted_nowhere(ray_arguments: list[bytes], s3_endpoint: dict,
                                                            tmp_path: Path) -> None:
    secrets = {os.environ[KEY_VAR], os.environ[SECRET_VAR]}
    bucket = f"prx-secrets-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1").create_bucket(Bucket=bucket)
    local = image_folder_source(tmp_path / "local", SOURCE, count=4)
    upload(local.parent / "images", bucket, "sources/photos", boto3.client(
        "s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1"))
    catalog_path = tmp_path / "sources.yaml"
    catalog_path.write_text(yaml.safe_dump({"sources": [
        {"name": SOURCE, "format": "imagefolder", "uri": f"s3://{bucket}/sources/photos"}]}))
    config_path = tmp_path / "prx-config.yaml"
    config_path.write_text(yaml.safe_dump({"storage": {"storage_options": s3_options(s3_endpoint["endpoint"])}}))
    settings = load_settings({"PRX_CONFIG": str(config_path)})
    root = f"s3://{bucket}/corpus"
    defs = build_definitions(make_settings(root, catalog_path, settings.config))
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.DagsterInstance.local_temp(str(home)) as instance:  # sqlite storage on disk, like a deployment
        sync_partitions(instance, load_catalog(catalog_path))
        log: list[str] = []
        outcome = run_build(defs, instance, [SOURCE], None, SELECT, echo=lambda *a, **k: log.append(" ".join(map(str, a))))
        assert outcome.ok, (outcome.failed_runs, outcome.failed_blocking, log)
        texts = instance_texts(instance)

    # the build really went through the referenced credentials: rows on S3, the worker env carries them
    storage = Storage(root, s3_options(s3_endpoint["endpoint"]))
    samples = lance_io.read_table(storage.lance_uri("samples"), ["sample_id"],
                                  storage_options=storage.lance_storage_options())
    assert samples.num_rows == 4
    assert ray.get(ray.remote(lambda: os.environ.get(SECRET_VAR)).remote()) == os.environ[SECRET_VAR]

    # Dagster: run records and their snapshots, every event, every metadata value, every file it wrote
    assert any(SECRET_VAR in text for key, text in texts.items() if key.startswith("job snapshot")), \
        "the job snapshot holds the storage options (with the variable's NAME)"
    texts["metadata"] = repr(outcome.metadata)
    texts["build log"] = "\n".join(log)
    for path in home.rglob("*"):
        if path.is_file():
            texts[f"file {path.relative_to(home)}"] = path.read_bytes().decode("utf-8", "replace")
    leaks = sorted(key for key, text in texts.items() for secret in secrets if secret in text)
    assert not leaks, leaks

    # Ray: every argument the driver pickled; Storage objects went to tasks, with the NAME only
    assert len(ray_arguments) > 20 and any(b"prx_core.store.storage" in blob for blob in ray_arguments)
    assert any(SECRET_VAR.encode() in blob for blob in ray_arguments)
    assert not [i for i, blob in enumerate(ray_arguments) for s in secrets if s.encode() in blob]

    # the explorer over the same root, opened the same way
    client = TestClient(create_app(storage), base_url="http://localhost")  # an allowed Host
    sample_id = samples["sample_id"][0].as_py()
    pages = ["/", "/overview", "/healthz", "/api/search", f"/sample?id={sample_id}"]
    assert "materialize `explorer`" not in client.get("/").text  # real pages: the build wrote the explorer's rows
    for page in [*pages, "/sample?id=nope", f"/api/neighbours?like={sample_id}", f"/?like={sample_id}", "/?q=noise"]:
        response = client.get(page)
        assert response.status_code == 200 if page in pages else response.status_code < 500, (page, response.status_code)
        assert not [s for s in secrets if s in response.text], page


def test_a_literal_secret_in_the_config_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "prx-config.yaml"
    config.write_text(yaml.safe_dump({"storage": {"storage_options": {
        "key": "AKIAEXAMPLE", "secret": "wJalrXUtnFEMI", "client_kwargs": {"endpoint_url": "http://minio:9000"}}}}))
    with pytest.raises(SettingsError) as refused:
        load_settings({"PRX_CONFIG": str(config)})
    message = str(refused.value)
    assert str(config) in message and "storage.storage_options.key, storage.storage_options.secret" in message
    assert "AWS_SECRET_ACCESS_KEY" in message and "{env: " in message
    assert "wJalrXUtnFEMI" not in message and "AKIAEXAMPLE" not in message

    # the same options given in Python, to the resource or to prx_core, are refused too
    with pytest.raises(ValueError, match="storage.storage_options: secret holds a secret value"):
        StorageResource(root="s3://bucket/corpus", storage_options={"secret": "wJalrXUtnFEMI"})
    with pytest.raises(ValueError, match="client_kwargs.aws_secret_access_key holds a secret value"):
        Storage("s3://bucket/corpus", {"client_kwargs": {"aws_secret_access_key": "wJalrXUtnFEMI"}})
    for section, fields in {"captioner": {"runtime_env": {"env_vars": {"HF_TOKEN": "hf_abc"}}},
                            "storage": {"storage_options": {"endpoint_url": "https://user:pw@minio:9000"}},
                            "explorer": {"base_url": "http://user:pw@explorer:8080"}}.items():
        config.write_text(yaml.safe_dump({section: fields}))
        with pytest.raises(SettingsError, match="holds a secret value"):
            load_settings({"PRX_CONFIG": str(config)})
    with pytest.raises(ValueError, match="explorer: base_url holds a secret value"):
        ExplorerResource(base_url="http://user:pw@explorer:8080")  # it would enter materialization metadata


def test_env_var_references_are_accepted_and_stay_names(tmp_path: Path) -> None:
    """`{env: NAME}` in YAML and `dg.EnvVar` in Python are both kept as the variable's name."""
    config = tmp_path / "prx-config.yaml"
    config.write_text(yaml.safe_dump({"storage": {"storage_options": {"secret": {"env": SECRET_VAR}}},
                                      "captioner": {"backend": "openai", "api_key_env": "OPENAI_API_KEY"}}))
    settings = load_settings({"PRX_CONFIG": str(config)})
    assert settings.section("storage")["storage_options"] == {"secret": {"env": SECRET_VAR}}
    resource = StorageResource(root="s3://bucket/corpus", storage_options={"secret": dg.EnvVar(SECRET_VAR)})
    assert resource.storage().storage_options == {"secret": {"env": SECRET_VAR}}
    assert os.environ[SECRET_VAR].encode() not in cloudpickle.dumps(resource.storage())
