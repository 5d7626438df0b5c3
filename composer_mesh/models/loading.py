"""How every role gets its model: `materialize` (config -> cached save_pretrained dir) and `load_pretrained`.

Trainer, generators and teachers all call `materialize` at startup; the first one builds (and warm-starts)
the model under a file lock and renames a finished temporary directory into place, the others wait for the
lock and reuse it. The directory is a plain transformers checkpoint (Qwen2 + a `tokenizers` tokenizer for
the tiny model, or a local source's own files) that `AutoModelForCausalLM`, `AutoTokenizer` and vLLM load.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from composer_mesh.models.build_progress import BuildProgress, progress_path
from composer_mesh.models.tiny import build_tiny
from composer_mesh.models.tokenizer import tiny_tokenizer
from composer_mesh.models.warmstart import warm_start

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from composer_mesh.models.config import ModelConfig

CACHE_ENV = "COMPOSER_MESH_CACHE"
META_FILE = "composer_mesh.json"  # written last inside a materialized dir: config, warm-start stats, timings

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir`, else `$COMPOSER_MESH_CACHE`, else `~/.cache/composer_mesh`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "composer_mesh"


def _quiet_transformers() -> None:
    """transformers' per-file tqdm bars would clutter the run's own progress display."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _load_dir(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    except Exception as e:
        raise ValueError(f"cannot load a transformers causal LM + tokenizer from {str(path)!r}: {e}") from e
    return model.eval(), tokenizer


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_ready(path: Path) -> bool:
    return (path / META_FILE).is_file() and (path / "config.json").is_file()


def materialize(config: ModelConfig, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return a save_pretrained directory (model + tokenizer) for `config`, building it once per cache key.

    A local source without a warm start is returned as is. Otherwise the directory is
    `<cache>/<tiny|local>-<config hash>`, built under a lock in a temporary directory and renamed into
    place, so concurrent processes never see a partial directory and all use the same bytes. A warm start
    reports its steps beside it (`build_progress`), for the run's status line.
    """
    if not config.is_tiny and config.warmstart is None:
        return Path(config.source)
    root = cache_root(cache_dir)
    name = f"{'tiny' if config.is_tiny else 'local'}-{config.cache_key()}"
    final = root / name
    if _is_ready(final):
        return final
    with _file_lock(root / f".{name}.lock"):
        if _is_ready(final):
            return final
        tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        steps = config.warmstart.steps if config.warmstart is not None else 0
        progress = BuildProgress(progress_path(root, name), name, steps)
        try:
            meta = _build_into(config, tmp, progress)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            if final.exists():  # a leftover without META_FILE (cannot happen via rename, but be safe)
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            progress.close()
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_into(config: ModelConfig, out: Path, progress: BuildProgress | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    if config.is_tiny:
        model, tokenizer = build_tiny(config)
    else:
        model, tokenizer = _load_dir(Path(config.source), torch.float32)
        model = model.to(torch.float32)
    t_build = time.perf_counter() - t0
    meta: dict[str, Any] = {
        "config": config.model_dump(mode="json"),
        "build_seconds": round(t_build, 3),
        "built_by_pid": os.getpid(),
    }
    if config.warmstart is not None:
        t1 = time.perf_counter()
        meta["warmstart"] = warm_start(model, tokenizer, config.warmstart, on_step=progress)
        meta["warmstart_seconds"] = round(time.perf_counter() - t1, 3)
    model = model.to(torch_dtype(config.dtype)).eval()
    out.mkdir(parents=True, exist_ok=False)
    _quiet_transformers()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return meta


def load_pretrained(
    config: ModelConfig, cache_dir: str | os.PathLike[str] | None = None, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Materialize `config` and load it (eval mode, `config.dtype`, on `device`). What every role calls."""
    path = materialize(config, cache_dir)
    model, tokenizer = _load_dir(path, torch_dtype(config.dtype))
    return model.to(device), tokenizer


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of `config` without building or training the model (cheap)."""
    if config.is_tiny:
        return tiny_tokenizer(config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.source, local_files_only=True)


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that define a model's weights, by state-dict name: every parameter (tied ones once, under
    their first name) and every persistent buffer. The trainer publishes and the generators load this set;
    the returned tensors share storage with the model."""
    named = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if attr not in module._non_persistent_buffers_set:
            named[name] = buf
    return {k: v.detach() for k, v in named.items()}


def materialized_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The build metadata (config, timings, warm-start stats) of a materialized directory ({} if none)."""
    p = Path(path) / META_FILE
    return json.loads(p.read_text()) if p.is_file() else {}
