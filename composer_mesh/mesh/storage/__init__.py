"""One storage primitive: a committed directory on any fsspec URL.

Run checkpoints, trainer states and DiLoCo checkpoints all need the same thing: a directory of files (safetensors
tensors and JSON, never pickle) that readers see only once it is complete and can check against what was written.
Each is a `CommittedDir`: files first, a commit marker last listing each file's size and sha256; a directory
without a valid marker is never used, and a file that differs from its marker is refused, named. Numbered ones (checkpoint steps, DiLoCo
rounds) are a `CommittedSeries`, which finds the newest committed one by listing and applies retention.

Storage is reached through `Blobs`, a six-method protocol: `FsspecBlobs` opens any fsspec URL (a local path,
`file://`, `s3://`); the DiLoCo plane passes its own `Store` (atomic and create-only puts, byte accounting).
"""

from composer_mesh.mesh.storage.blobs import Blobs, FsspecBlobs, absolute
from composer_mesh.mesh.storage.committed import (
    MARKER_VERSION,
    CommittedDir,
    ContentError,
    NotCommitted,
    StorageError,
)
from composer_mesh.mesh.storage.series import Committed, CommittedSeries

__all__ = ["MARKER_VERSION", "Blobs", "Committed", "CommittedDir", "CommittedSeries", "ContentError", "FsspecBlobs",
           "NotCommitted", "StorageError", "absolute"]
