"""Fixtures for the DiLoCo object-store tier, started per module on localhost: a real S3 server (moto) and a real
GCS API server (gcp-storage-emulator, behind the create-only proxy of `gcs.py`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from services import require_module

from mesh.objectstore.gcs import GCS_ENV, CreateOnlyProxy, Emulator, create_bucket

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
for _k, _v in GCS_ENV.items():  # at collection: before any test of this session can import gcsfs
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    require_module("moto")
    require_module("s3fs")
    from moto.server import ThreadedMotoServer

    for k, v in S3_ENV.items():
        os.environ.setdefault(k, v)
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        srv.stop()


@pytest.fixture
def s3_store(moto_endpoint: str) -> dict:
    """A fresh bucket; returns the DiLoCoConfig store fields (credentials by env var name only)."""
    import boto3

    bucket = f"diloco-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                 aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=bucket)
    return {
        "store_uri": f"s3://{bucket}/diloco",
        "storage_options": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"},
        "credentials_env": {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY"},
    }


@pytest.fixture(scope="module")
def gcs_endpoint() -> Iterator[str]:
    """The create-only proxy's URL, in front of a fresh in-memory emulator."""
    require_module("gcsfs")
    require_module("gcp_storage_emulator")
    emulator = Emulator()
    proxy = CreateOnlyProxy(emulator.port)
    try:
        yield proxy.endpoint
    finally:
        proxy.stop()
        emulator.stop()


@pytest.fixture
def gcs_store(gcs_endpoint: str) -> dict:
    """A fresh bucket; returns the DiLoCoConfig store fields (gcsfs's token by env var name, like a real one)."""
    bucket = f"diloco-{uuid.uuid4().hex[:10]}"
    create_bucket(gcs_endpoint, bucket)
    return {
        "store_uri": f"gs://{bucket}/diloco",
        "storage_options": {"endpoint_url": gcs_endpoint, "project": "test"},
        "credentials_env": {"token": "GCS_TEST_TOKEN"},
    }
