"""What each fsspec protocol needs so that writers on several hosts agree: one table, one opener.

Why this exists: fsspec backends differ exactly where a multi-writer protocol cares, and the differences used to
be `if scheme == "s3"` branches. Each protocol the docs name is a row of `BACKENDS`, and `open_filesystem` is the
only place that turns a row into fsspec options. Every row is run by the tests against a real server
(`tests/mesh/objectstore/`: moto for s3, gcp-storage-emulator for gs); a protocol that is not a row is opened with
the caller's options alone, as fsspec would.

- listings: s3fs and gcsfs cache directory listings with no expiry, so a replica's `list()` (or `exists()`) would
  miss the rounds and markers other replicas write; their rows turn the cache off.
- instances: fsspec hands back one cached filesystem per set of options. With listings uncached, a shared instance
  holds no state that can go stale, so this is the caller's choice, not the protocol's: a DiLoCo `Store` (one per
  replica, long-lived) asks for its own client (`own_client`), so replicas that are threads of one process (tests,
  benchmarks) are separate clients as on separate hosts; `FsspecBlobs` (opened per checkpoint operation) shares the
  cached one (a fresh s3 client per operation made the S3 run-checkpoint test 10 s slower).
- create-only: `link` (`os.link` of a finished temp file fails if the name exists), `lock` (one process-wide
  lock: memory:// only lives in one process) or `precondition` (the server refuses an existing key: S3
  `If-None-Match: *`, GCS `ifGenerationMatch=0`; fsspec's `pipe_file(mode="create")` sends it and raises
  FileExistsError on 412).
- atomic puts: `local` backends write a temp file and rename it; on object stores one request is atomic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Backend:
    """One fsspec protocol's row: how to open it and how its writes are made atomic."""

    name: str
    local: bool = False  # a local filesystem: atomic puts by temp file + rename, reads straight into memory
    create_only: Literal["link", "lock", "precondition"] = "precondition"
    listings_cache: bool = True  # whether the fsspec implementation may cache listings (False: always fresh)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # options set unless the caller sets them
    client_keys: tuple[str, ...] = ()  # top-level options that belong in `client_kwargs` (s3fs: botocore's)

    def options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """`given` plus this row's settings (the caller's own values win over `defaults`, never over the cache)."""
        opts = {**self.defaults, **given}
        client = {k: opts.pop(k) for k in self.client_keys if k in opts}
        if client:
            opts["client_kwargs"] = {**(opts.get("client_kwargs") or {}), **client}
        if not self.listings_cache:
            opts["use_listings_cache"] = False
        return opts


_GCS = Backend("gs", listings_cache=False)
BACKENDS: dict[str, Backend] = {
    "file": Backend("file", local=True, create_only="link", defaults={"auto_mkdir": True}),
    "memory": Backend("memory", create_only="lock"),
    "s3": Backend("s3", listings_cache=False, client_keys=("endpoint_url", "region_name")),
    "gs": _GCS,
    "gcs": _GCS,  # fsspec's other name for gcsfs
}
OTHER = Backend("other")  # any other fsspec protocol: the caller's options, nothing assumed


def backend_for(url: str) -> Backend:
    """The row for `url`'s protocol (a plain path is `file`)."""
    scheme = url.partition("://")[0] if "://" in url else "file"
    return BACKENDS.get(scheme, OTHER)


def open_filesystem(url: str, options: Mapping[str, Any] | None = None, own_client: bool = False) -> tuple[Any, str]:
    """(fsspec filesystem, path on it) for `url`, with its backend's settings applied to `options`; `own_client`
    skips fsspec's instance cache (a client nobody else in this process shares)."""
    import fsspec

    opts = backend_for(url).options(dict(options or {}))
    if own_client:
        opts["skip_instance_cache"] = True
    return fsspec.core.url_to_fs(url, **opts)
