"""Where an Iceberg table's files are: a location as a path of this machine, or as an object in a store, and the
options that reach that store as the table's own Hadoop FileIO does. Pure Python: the copy's tasks, the row-delta
writer, the readers of metadata and the removal of files an interrupted copy left all resolve locations here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlparse


def local_path(location: str) -> str | None:
    """A ``file:`` location (``file:/x``, ``file:///x``, percent-encoded as Hadoop writes URIs) or a plain absolute
    path as a path of this machine; None for any other scheme (object stores, HDFS), which only the table's
    FileIO reaches."""
    if location.startswith("file:"):
        return unquote(urlparse(location).path)
    return location if location.startswith("/") else None


def object_path(location: str) -> str:
    """An object store location (``s3a://bucket/key``) as pyarrow's file systems name it (``bucket/key``)."""
    return location.split("://", 1)[1]


# Hadoop's credential providers whose credentials pyarrow finds the same way: the keys in the settings, or
# the AWS SDK's default chain (environment, profile, instance metadata)
_PLAIN_PROVIDERS = ("SimpleAWSCredentialsProvider", "TemporaryAWSCredentialsProvider",
                    "EnvironmentVariableCredentialsProvider", "IAMInstanceCredentialsProvider",
                    "InstanceProfileCredentialsProvider", "DefaultAWSCredentialsProviderChain")


def hadoop_s3_options(location: str, hadoop: Callable[[str], Any]) -> dict[str, Any] | None:
    """Keyword arguments of ``pyarrow.fs.S3FileSystem`` that reach ``location`` (``s3a://``, ``s3://``) as Hadoop's
    s3a client does with the settings ``hadoop`` gives (a key's value, or None: ``fs.s3a.*``, per-bucket
    ``fs.s3a.bucket.<bucket>.*`` first). None when ``location`` is not on S3, or its credentials come from a
    provider pyarrow cannot stand in for (e.g. an assumed role)."""
    parsed = urlparse(location)
    if parsed.scheme not in ("s3a", "s3", "s3n"):
        return None

    def setting(name: str) -> str | None:
        value = hadoop(f"fs.s3a.bucket.{parsed.netloc}.{name}") or hadoop(f"fs.s3a.{name}")
        return str(value).strip() or None if value else None

    providers = setting("aws.credentials.provider") or ""
    anonymous = "AnonymousAWSCredentialsProvider" in providers
    if providers and not anonymous and not all(
            p.strip().rsplit(".", 1)[-1] in _PLAIN_PROVIDERS for p in providers.split(",") if p.strip()):
        return None
    options: dict[str, Any] = {"anonymous": anonymous}
    if not anonymous and setting("access.key") and setting("secret.key"):
        options.update(access_key=setting("access.key"), secret_key=setting("secret.key"),
                       session_token=setting("session.token"))
    region = setting("endpoint.region") or setting("region")
    if region:
        options["region"] = region
    endpoint = setting("endpoint")
    ssl = (setting("connection.ssl.enabled") or "true").lower() != "false"
    if endpoint:
        if "://" in endpoint:
            scheme, endpoint = endpoint.split("://", 1)
            ssl = scheme == "https"
        options["endpoint_override"] = endpoint.rstrip("/")
        # pyarrow addresses buckets by path when it is given an endpoint, Hadoop only when told to
        options["force_virtual_addressing"] = (setting("path.style.access") or "false").lower() != "true"
    options["scheme"] = "https" if ssl else "http"
    return options
