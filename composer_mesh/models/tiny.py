"""The tiny built-in model, its character-level tokenizer, and `materialize` (config -> save_pretrained dir).

Everything here is offline and deterministic: the same `ModelConfig` gives bitwise the same weights in every
process (weights are initialised under a forked RNG seeded with `config.seed`). Trainer, generators and
teachers all call `materialize` at startup; the first one builds (and warm-starts) the model under a file
lock and renames a finished temporary directory into place, the others wait for the lock and reuse it.
The directory is a plain transformers checkpoint (Qwen2 + a `tokenizers` tokenizer) that
`AutoModelForCausalLM`, `AutoTokenizer` and vLLM load.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from composer_mesh.models.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"  # end of text; also the pad token
CACHE_ENV = "COMPOSER_MESH_CACHE"
META_FILE = "composer_mesh.json"  # written last inside a materialized dir: config, warm-start stats, timings

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir`, else `$COMPOSER_MESH_CACHE`, else `~/.cache/composer_mesh`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "composer_mesh"


def _task_alphabet_and_eos(task_name: str) -> tuple[str, str | None]:
    from composer_mesh.tasks import get_task

    task = get_task(task_name)
    return task.alphabet, getattr(task, "eos", None)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a byte-level BPE stores in its vocab)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: `<|endoftext|>` (id 0, also pad) then one id per character of `alphabet`.

    It is a `Qwen2Tokenizer` (byte-level BPE) with no merges and a vocabulary holding only the alphabet's
    bytes. That is deliberate: transformers 5 (and so vLLM) always rebuilds a qwen2 model's tokenizer as
    `Qwen2Tokenizer` from the saved vocab, so building it the same way here makes the in-memory tokenizer
    and every reloaded copy identical. ASCII characters are one id each (`"3+4="` -> 4 ids); nothing is
    added around the text. Characters outside the alphabet are dropped by the BPE (it has no unk), so
    encode untrusted text with `encode_checked`.
    """
    from transformers import Qwen2Tokenizer

    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {EOS_TOKEN: 0}
    for ch in alphabet:
        for byte in ch.encode("utf-8"):
            vocab.setdefault(b2u[byte], len(vocab))
    return Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, unk_token=EOS_TOKEN)


def encode_checked(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Encode without special tokens; raise if the ids do not decode back to `text` (characters not covered)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    back = tokenizer.decode(ids)
    if back != text:
        missing = sorted({ch for ch in text if ch not in back})
        raise ValueError(
            f"the tokenizer cannot represent {text!r} (round trip gives {back!r}; characters not covered: {missing})"
        )
    return ids


def tiny_tokenizer(config: ModelConfig) -> PreTrainedTokenizerFast:
    alphabet, _ = _task_alphabet_and_eos(config.task)
    return build_tokenizer(alphabet)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, extra_texts: tuple[str, ...] = ()) -> list[int]:
    """The tokenizer's EOS plus every `extra_texts` string that is a single token (e.g. the task's ';')."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    for text in extra_texts:
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(int(enc[0]))
    return ids


def build_tiny_model(config: ModelConfig, vocab_size: int, eos_ids: list[int], pad_id: int) -> PreTrainedModel:
    """A randomly initialised tiny Qwen2, bitwise identical for the same config in every process."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    hf_cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,  # no aliased tensors: simpler for the weight plane and vLLM reloads
        eos_token_id=eos_ids[0],
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(hf_cfg)
    # Both EOS and the task's end marker stop generation (transformers generate() and vLLM read this).
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id)
    return model.to(torch.float32).eval()


def build_tiny(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Untrained tiny model + tokenizer from `config` (no cache, no warm start)."""
    if not config.is_tiny:
        raise ValueError(f"build_tiny needs model.source='tiny', got {config.source!r}")
    alphabet, eos = _task_alphabet_and_eos(config.task)
    tokenizer = build_tokenizer(alphabet)
    eos_ids = stop_token_ids(tokenizer, (eos,) if eos else ())
    model = build_tiny_model(config, len(tokenizer), eos_ids, int(tokenizer.pad_token_id))
    return model, tokenizer


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
def _file_lock(path: Path):
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
    place, so concurrent processes never see a partial directory and all use the same bytes.
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
        try:
            meta = _build_into(config, tmp)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            if final.exists():  # a leftover without META_FILE (cannot happen via rename, but be safe)
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_into(config: ModelConfig, out: Path) -> dict[str, Any]:
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
        from composer_mesh.models.warmstart import warm_start

        t1 = time.perf_counter()
        meta["warmstart"] = warm_start(model, tokenizer, config.warmstart)
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


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of `config` without building or training the model (cheap)."""
    if config.is_tiny:
        return tiny_tokenizer(config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.source, local_files_only=True)


def materialized_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The build metadata (config, timings, warm-start stats) of a materialized directory ({} if none)."""
    p = Path(path) / META_FILE
    return json.loads(p.read_text()) if p.is_file() else {}
