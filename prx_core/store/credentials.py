"""Object-store credentials: taken from the environment of the process that opens the store, never
from configuration, never carried in a pickled task argument.

Configuration is persisted: Dagster stores the resources' config in the job snapshot of every run
(and shows it in the UI), and Ray pickles every task's arguments. So storage options hold no
secret values, only where to find them:

* nothing at all: s3fs (botocore) and Lance (object_store) read the standard chain themselves on
  each process: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE, an
  IAM role or web identity (IRSA);
* `{env: NAME}` references, e.g. `secret: {env: CORPUS_S3_SECRET}` (in Python,
  `dg.EnvVar("CORPUS_S3_SECRET")` becomes the same reference), resolved from `os.environ` when a
  filesystem or Lance options are built, i.e. on the Ray worker that does the I/O.

A literal value under a secret-like name (key, secret, token, password, credentials...) or a
password inside a URL is refused with `SecretInConfigError`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from typing import Any

SECRET_WORDS = frozenset({"key", "secret", "token", "password", "passwd", "pwd", "credential", "credentials",
                          "apikey"})
URL_PASSWORD = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s]*:[^/@\s]+@")
REDACTED = "***"
HOW = ("Give credentials through the environment of the Dagster process and of every Ray worker instead: "
       "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, AWS_PROFILE or an IAM role), which "
       "s3fs and Lance read by themselves, or a reference to a variable, e.g. `secret: {env: CORPUS_S3_SECRET}` "
       "(dg.EnvVar in Python); an API key's variable is named by `api_key_env`. See deploy/README.md.")


class SecretInConfigError(ValueError):
    """A secret value written into configuration, which Dagster and Ray would persist."""


class MissingCredentialError(RuntimeError):
    """An `{env: NAME}` reference whose variable is not set in the process opening the store."""


def secret_like(name: str) -> bool:
    """Whether an option named `name` holds a secret. `*_env` options hold a variable's NAME."""
    if name.lower().endswith("_env"):
        return False
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower())
    return any(word in SECRET_WORDS for word in words)


def is_reference(value: Any) -> bool:
    """`{env: NAME}`: the shape of a reference (Dagster writes dg.EnvVar values the same way)."""
    return isinstance(value, Mapping) and set(value) == {"env"} and isinstance(value["env"], str) and bool(value["env"])


def find_literal_secrets(options: Any, path: str = "", under_secret: bool = False) -> list[str]:
    """Dotted paths of the literal secrets in a nested mapping: values under secret-like names
    (at any depth below one; references, None, booleans and "" aside) and URLs carrying a password."""
    found: list[str] = []
    if is_reference(options):
        return found
    if isinstance(options, Mapping):
        for name, value in options.items():
            where = f"{path}.{name}" if path else str(name)
            found.extend(find_literal_secrets(value, where, under_secret or secret_like(str(name))))
    elif isinstance(options, (list, tuple)):
        for i, value in enumerate(options):
            found.extend(find_literal_secrets(value, f"{path}[{i}]", under_secret))
    elif under_secret and not isinstance(options, bool) and options not in (None, ""):
        found.append(path or "<value>")
    elif isinstance(options, str) and URL_PASSWORD.match(options):
        found.append(path or "<value>")
    return found


def refuse_literal_secrets(options: Any, where: str) -> None:
    """Raise `SecretInConfigError` naming every literal secret in `options` and how to give it instead."""
    if found := find_literal_secrets(options):
        holds = "holds a secret value" if len(found) == 1 else "hold secret values"
        raise SecretInConfigError(f"{where}: {', '.join(found)} {holds}; secrets never go in configuration (it is "
                                  f"stored with every Dagster run and sent to every Ray task). {HOW}")


def resolve_references(options: Any, path: str = "") -> Any:
    """A copy of `options` with every `{env: NAME}` replaced by `os.environ[NAME]` of THIS process."""
    if is_reference(options):
        name = options["env"]
        if (value := os.environ.get(name)) is None:
            raise MissingCredentialError(
                f"storage option {path or '<value>'} refers to the environment variable {name}, which is not set in "
                f"this process (host {socket.gethostname()}, pid {os.getpid()}). Set it wherever the store is "
                "opened: the Dagster run process and every Ray worker (e.g. a secretKeyRef env var of the Ray "
                "pods; see deploy/README.md).")
        return value
    if isinstance(options, Mapping):
        return {k: resolve_references(v, f"{path}.{k}" if path else str(k)) for k, v in options.items()}
    if isinstance(options, list):
        return [resolve_references(v, f"{path}[{i}]") for i, v in enumerate(options)]
    return options


def redact(options: Any) -> Any:
    """`options` with secret-like values replaced by `***`, for messages and reprs."""
    if isinstance(options, Mapping):
        return {k: REDACTED if secret_like(str(k)) and v not in (None, "") and not is_reference(v) else redact(v)
                for k, v in options.items()}
    if isinstance(options, list):
        return [redact(v) for v in options]
    if isinstance(options, str) and URL_PASSWORD.match(options):
        return re.sub(r"(://[^/@\s]*:)[^/@\s]+@", rf"\1{REDACTED}@", options)
    return options
