"""Test helper: rewrite a safetensors object's JSON header (to forge foreign or corrupt shards)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any


def rewrite_header(blob: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """`blob` with its header passed through `edit` (in place); tensor bytes untouched, header re-padded."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    edit(header)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + blob[8 + n :]
