"""Where the corpus lives: a local folder or an s3:// prefix, through one URI-aware layer."""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster._core.definitions.utils import is_valid_owner
from pydantic import Field, field_validator

from prx_core.image.buckets import TIERS
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.store.credentials import refuse_literal_secrets
from prx_core.store.storage import Storage

DEFAULT_OWNERS = ("team:data",)


def env_references(value: Any) -> Any:
    """`dg.EnvVar("NAME")` anywhere in the options becomes `{env: NAME}` (what Dagster stores for it),
    so it is resolved on the worker that opens the store, never in this process."""
    if isinstance(value, dg.EnvVar):
        return {"env": value.env_var_name}
    if isinstance(value, dict):
        return {k: env_references(v) for k, v in value.items()}
    if isinstance(value, list):
        return [env_references(v) for v in value]
    return value


class StorageResource(dg.ConfigurableResource):
    """The corpus root: Lance tables under `<root>/lance`, MDS under `<root>/mds`, skip-lists under
    `<root>/skiplists`. Local paths and `s3://bucket/prefix` URIs work the same.

    Its config is stored in every run's job snapshot and its `Storage` goes to every Ray task, so
    `storage_options` never hold a secret: credentials come from the environment of each process
    (the AWS chain, or `{env: NAME}` / `dg.EnvVar` references resolved on the worker), and a
    literal key/secret/token is refused when the definitions load."""

    root: str = Field(description="Local folder or s3://bucket/prefix holding the corpus.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="s3fs options (endpoint_url, client_kwargs, ...), translated for Lance. No secret values: "
                    "credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile or IAM role) "
                    "or from references such as `secret: {env: NAME}`, resolved on each worker.",
    )
    max_tier: int = Field(default=TIERS[-1], description="Largest resolution tier (512, 1024, 2048 or 4096).")
    max_pixels: int = Field(default=DEFAULT_MAX_PIXELS, description="Images above this many pixels are rejected unread.")
    owners: list[str] = Field(default_factory=lambda: list(DEFAULT_OWNERS), description=(
        "Dagster owners of every corpus asset: `team:<name>` or an email address (what the UI's owner filter shows)."))

    @field_validator("owners")
    @classmethod
    def _dagster_owners(cls, value: list[str]) -> list[str]:
        """Checked when the settings load, so a bad owner names the setting instead of failing the definitions."""
        bad = [o for o in value if not is_valid_owner(o)]  # Dagster's rule: an email or team:<name>
        if bad:
            raise ValueError(f"storage.owners: {bad} are not owners; use `team:<name>` or an email address")
        return value

    @field_validator("storage_options", mode="before")
    @classmethod
    def _no_secret_values(cls, value: Any) -> Any:
        value = env_references(value)
        refuse_literal_secrets(value, "storage.storage_options")
        return value

    def storage(self) -> Storage:
        return Storage(self.root, env_references(dict(self.storage_options)))

    def tier_version(self) -> str:
        """Changes bucket geometry: part of the code version of `buckets` and `mds_shards`."""
        return f"tier{self.max_tier}"

    def pixel_cap_version(self) -> str:
        """Changes which images are refused: part of the code version of `samples`."""
        return f"px{self.max_pixels}"
