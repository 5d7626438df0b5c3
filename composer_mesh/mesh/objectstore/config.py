"""The topology's optional `diloco:` section: how trainer replicas synchronise through an object store.

Kept import-cheap (pydantic only) so topology validation does not pull in torch, torchft or fsspec.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer_mesh.errors import FieldError

SUPPORTED_SCHEMES: tuple[str, ...] = ("file", "s3", "gs", "memory")

# Storage options that carry secrets. They may only be supplied through `credentials_env` (env var NAMES).
SECRET_OPTION_NAMES: frozenset[str] = frozenset(
    {"key", "secret", "token", "password", "session_token", "aws_access_key_id", "aws_secret_access_key",
     "aws_session_token", "access_key", "secret_key", "client_secret", "api_key", "credentials"}
)

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class OuterOptimizerConfig(BaseModel):
    """Outer optimizer applied to the averaged pseudo-gradient (DiLoCo paper: SGD, Nesterov, lr 0.7, m 0.9)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    kind: Literal["sgd"] = Field("sgd", description="Outer optimizer family. Only SGD is supported.")
    lr: float = Field(0.7, gt=0.0, description="Outer learning rate (DiLoCo paper: 0.7).")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Outer momentum (DiLoCo paper: 0.9).")
    nesterov: bool = Field(True, description="Use Nesterov momentum (DiLoCo paper: true).")
    scope: Literal["per_fragment", "shared"] = Field(
        "per_fragment",
        description="One outer optimizer per streaming fragment ('per_fragment'), or a single optimizer over "
        "the whole model ('shared'). 'shared' is refused when fragments > 1: it steps the other fragments' "
        "leftover inner gradients with the outer lr and diverges.",
    )

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterOptimizerConfig:
        if self.nesterov and self.momentum == 0.0:
            raise FieldError("nesterov", "outer_optimizer.nesterov=true needs outer_optimizer.momentum > 0 (torch "
                             "SGD rule)")
        return self


class DiLoCoConfig(BaseModel):
    """DiLoCo across trainer replicas, synchronised through an fsspec object store every `sync_every` steps."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    store_uri: str = Field(
        ...,
        description="Root of the object store, one of file://, s3://, gs:// or memory:// (memory:// only "
        "works between threads of one process). s3:// and gs:// are tested against local servers (moto, "
        "gcp-storage-emulator). Example: s3://bucket/diloco.",
    )
    storage_options: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Extra fsspec filesystem options without secrets, e.g. {endpoint_url: http://127.0.0.1:9000}"
        " for S3 ('endpoint_url' and 'region_name' are moved into s3fs client_kwargs automatically) or "
        "{project: my-project} for gs. Listing caches are always off for s3 and gs (replicas list each "
        "other's writes).",
    )
    credentials_env: dict[str, str] = Field(
        default_factory=dict,
        description="Secret storage options given by environment variable NAME, e.g. "
        "{key: AWS_ACCESS_KEY_ID, secret: AWS_SECRET_ACCESS_KEY} for s3 or {token: GCS_TOKEN} for gs (gcsfs's "
        "token: a service-account JSON path, 'google_default', ...). Values are read at connect time and never "
        "logged.",
    )
    run_id: str = Field(
        ...,
        description="Namespace of this run inside the store; two runs with different ids never mix. "
        "Letters, digits, '.', '_', '-' (max 128).",
    )
    replicas: int = Field(2, ge=1, description="Number of DiLoCo trainer replicas (the trainer role's replicas).")
    sync_every: int = Field(100, ge=1, description="Inner steps between outer synchronisations (H).")
    outer_optimizer: OuterOptimizerConfig = Field(
        default_factory=OuterOptimizerConfig, description="Outer optimizer settings."
    )
    fragments: int = Field(
        1, ge=1, description="Streaming DiLoCo: number of model fragments synced in turn (1 = plain DiLoCo)."
    )
    fragment_sync_delay: int = Field(
        0,
        ge=0,
        description="Streaming DiLoCo: inner steps between starting a fragment's reduction and applying it "
        "(overlaps I/O with compute). Must be < sync_every / fragments.",
    )
    fragment_update_alpha: float = Field(
        0.0, ge=0.0, le=1.0, description="Mix of local params into the synced fragment (0 = pure outer update)."
    )
    quorum_deadline_s: float = Field(
        60.0,
        gt=0.0,
        description="Seconds a round waits for replicas. Replicas that have not published their shard by "
        "then are left out of the round; the survivors average over who arrived.",
    )
    compression: Literal["none", "bf16"] = Field(
        "none", description="Pseudo-gradient compression on the wire: 'none' (fp32) or 'bf16' (half the bytes)."
    )
    bucket_cap_mb: float | None = Field(
        None,
        gt=0.0,
        description="If set, torchft packs pseudo-gradients into flat buckets of this many MiB before the "
        "allreduce (the store plane sends one vector per round either way). Must be at least the largest "
        "parameter tensor, or torchft silently skips it (checked by check_against).",
    )
    poll_interval_s: float = Field(
        0.05, gt=0.0, le=5.0, description="Longest pause between store polls (polls start at 2 ms and back off)."
    )
    keep_rounds: int = Field(
        2, ge=1, description="Completed rounds kept in the store before garbage collection."
    )

    @field_validator("store_uri")
    @classmethod
    def _check_uri(cls, v: str) -> str:
        scheme, sep, rest = v.partition("://")
        if not sep or scheme not in SUPPORTED_SCHEMES:
            raise ValueError(
                f"store_uri {v!r}: scheme must be one of {', '.join(s + '://' for s in SUPPORTED_SCHEMES)}"
            )
        if not rest.strip("/"):
            raise ValueError(f"store_uri {v!r}: needs a path (or bucket) after {scheme}://")
        return v.rstrip("/")

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, v: str) -> str:
        if not _RUN_ID.match(v):
            raise ValueError(f"run_id {v!r}: use letters, digits, '.', '_', '-' (max 128, no '/')")
        return v

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, v: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        bad = sorted(k for k in v if k.lower() in SECRET_OPTION_NAMES)
        if bad:
            raise ValueError(
                f"storage_options {bad}: secrets are not allowed in config; name an environment variable in "
                f"credentials_env instead, e.g. credentials_env: {{{bad[0]}: MY_ENV_VAR}}"
            )
        return v

    @field_validator("credentials_env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for opt, env in v.items():
            if not _ENV_NAME.match(env):
                raise ValueError(
                    f"credentials_env[{opt!r}]: {env!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
                )
        return v

    @model_validator(mode="after")
    def _check_schedule(self) -> DiLoCoConfig:
        if self.sync_every % self.fragments != 0:
            raise FieldError("fragments", f"sync_every={self.sync_every} must be divisible by fragments="
                             f"{self.fragments}")
        per_fragment = self.sync_every // self.fragments
        if self.fragment_sync_delay >= per_fragment:
            raise FieldError("fragment_sync_delay", f"fragment_sync_delay={self.fragment_sync_delay} must be < "
                             f"sync_every/fragments={per_fragment}")
        if self.fragments > 1 and self.outer_optimizer.scope == "shared":
            raise FieldError(
                ("outer_optimizer", "scope"),
                f"outer_optimizer.scope='shared' with fragments={self.fragments} silently diverges (one optimizer "
                "steps other fragments' inner gradients); use scope='per_fragment'"
            )
        return self

    @property
    def scheme(self) -> str:
        return self.store_uri.partition("://")[0]

    def checkpointable(self, step: int) -> bool:
        """Whether a replica's full state may be saved after `step` inner steps (counted from the run's start).

        A fragment's sync is prepared `fragment_sync_delay` steps before it is applied; in between its round is
        in flight (pseudo-gradients sent, result not yet applied) and cannot be saved. With delay 0 every step
        is safe: a round is prepared and applied within one optimizer step."""
        per_fragment = self.sync_every // self.fragments
        return step % per_fragment < per_fragment - self.fragment_sync_delay

    def check_against(self, named_shapes: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int], int]],
                      bytes_per_element: int = 4) -> None:
        """Refuse settings that would silently diverge for this model.

        `named_shapes` maps parameter name -> shape (elements of `bytes_per_element` bytes each), or is an
        iterable of (name, shape, element_size). Raises ValueError naming the offending tensor.
        """
        items: list[tuple[str, Sequence[int], int]]
        if isinstance(named_shapes, Mapping):
            items = [(n, s, bytes_per_element) for n, s in named_shapes.items()]
        else:
            items = [(n, s, e) for n, s, e in named_shapes]
        if not items:
            raise ValueError("diloco.check_against: the model has no parameters to synchronise")
        if self.bucket_cap_mb is None:
            return
        cap = int(self.bucket_cap_mb * 1024 * 1024)
        name, shape, esize = max(items, key=lambda it: _numel(it[1]) * it[2])
        nbytes = _numel(shape) * esize
        if nbytes > cap:
            raise ValueError(
                f"diloco.bucket_cap_mb={self.bucket_cap_mb} ({cap} bytes) is smaller than parameter {name!r} "
                f"(shape {tuple(shape)}, {nbytes} bytes): torchft would silently skip it and replicas would "
                f"diverge; set bucket_cap_mb >= {nbytes / 2**20:.3f} or leave it unset"
            )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
