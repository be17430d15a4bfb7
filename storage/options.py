"""fsspec options for a storage URI (checkpoints, data files, artifacts): the one place an S3 endpoint is chosen."""

from __future__ import annotations

import os


def storage_options_for(path: str, *, endpoint_url: str | None = None) -> dict:
    """fsspec options for ``path``: for s3:// an endpoint from the config or $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL.
    Credentials come from the environment (boto's usual chain) and are never put in configs or logs."""
    if not path.startswith("s3://"):
        return {}
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
