"""Prompts from local data (`run.data`): JSONL, Parquet, a `datasets.save_to_disk` directory, or a hub dataset
already in the local `datasets` cache. Nothing is downloaded: hub reads run with the Hub forced offline.

Rows come back as plain `DataRow`s (prompt text or chat messages, answer, extra columns), validated here so a bad
row fails the run before it starts, with an error naming its file, row and field. The held-out split is chosen by
a hash of each row's prompt, never by position: it is the same across runs, seeds and shuffles, and a prompt
that occurs twice is on one side only, so train and eval are disjoint by construction.

Import-cheap (pydantic only): `RunConfig` embeds `DataConfig`, and validating a topology imports no reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from composer_mesh.errors import FieldError, UserInputError

Format = Literal["auto", "jsonl", "parquet", "disk"]
_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_HELD_OUT_SALT = "composer-mesh/held-out\0"


class DataConfig(BaseModel):
    """Where a run's prompts come from and which columns mean what (the topology's `run.data`)."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None, description="A local file or directory: `.jsonl`, `.parquet`, or a `datasets.save_to_disk` directory."
    )
    hub: str | None = Field(
        None, description="Instead of `path`: a hub dataset name ('org/name') already in the local `datasets` cache; "
        "read with the Hub forced offline (HF_HUB_OFFLINE=1), never downloaded."
    )
    hub_config: str | None = Field(None, description="The hub dataset's config name (e.g. 'main'), if it has several.")
    cache_dir: str | None = Field(None, description="The `datasets` cache holding `hub`; null: HF_DATASETS_CACHE.")
    format: Format = Field("auto", description="'auto' picks by suffix (.jsonl, .parquet; a directory: disk).")
    split: str = Field("train", description="Which split of a DatasetDict directory or hub dataset to train on.")
    prompt: str | None = Field(None, description="Column with the prompt text (default 'prompt', unless `messages`).")
    messages: str | None = Field(
        None, description="Instead of `prompt`: column with chat messages, a list of {role, content}."
    )
    answer: str | None = Field("answer", description="Column with the reference answer (null: rows have none).")
    extra: list[str] = Field(
        default_factory=list, description="Further columns passed with each prompt to the rewards (`Prompt.extra`)."
    )
    eval_path: str | None = Field(None, description="A separate eval file or directory (same format rules and columns).")
    eval_split: str | None = Field(None, description="Another split of the same dataset to evaluate on (e.g. 'test').")
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="Hold out this fraction of the rows for eval, chosen by a hash of the prompt."
    )
    eval_size: int | None = Field(
        None, ge=0, description="Hold out this many distinct prompts for eval, chosen by a hash of the prompt. With no "
        "eval_* set: a tenth of the distinct prompts, at most 64."
    )
    seed: int | None = Field(None, description="Seed of the per-epoch shuffle; null: run.seed.")

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if (self.path is None) == (self.hub is None):
            raise FieldError("hub" if self.hub is not None else "path", "data needs exactly one of `path` (a local "
                             "file or directory) and `hub` (a cached hub dataset name)")
        if self.prompt is not None and self.messages is not None:
            raise FieldError("messages", "data: set `prompt` (a text column) or `messages` (a chat column), not both")
        evals = [k for k in ("eval_path", "eval_split", "eval_fraction", "eval_size") if getattr(self, k) is not None]
        if len(evals) > 1:
            raise FieldError(evals[1], f"data: {' and '.join(evals)} both choose the eval set; set one")
        if self.hub is not None and (self.format != "auto" or self.eval_path is not None):
            raise FieldError("format" if self.format != "auto" else "eval_path", "data: `format` and `eval_path` are "
                             "for local files; a hub dataset has splits (`split`, `eval_split`)")
        taken = [c for c in (self.prompt_field, self.answer) if c in self.extra]
        if taken:
            raise FieldError(("extra", self.extra.index(taken[0])), f"data.extra repeats the column(s) {taken} "
                             "already mapped to the prompt or answer")
        return self

    @property
    def prompt_field(self) -> str:
        """The column the prompt is read from: `messages` for chat data, else `prompt` (default 'prompt')."""
        return self.messages or self.prompt or "prompt"


class DataError(UserInputError, ValueError):
    """Data that cannot be read: a missing file, an unknown format, an absent split or cached dataset."""


class DataRowError(DataError):
    """A malformed row: names the file, the row (1-based; the line for JSONL) and the field."""

    def __init__(self, file: str, row: int, field: str | None, problem: str) -> None:
        self.file, self.row, self.field = file, row, field
        where = f"{file}, row {row}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class DataRow:
    """One prompt of a data set. `text` is the prompt, or the last user message of chat data (what rewards get
    as the prompt); `key` is what identifies the prompt for the held-out split and the data digest."""

    text: str
    answer: str | None
    messages: list[dict[str, str]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    where: str = field(default="", compare=False)  # "file, row N", for messages about the row
    tools: list[dict[str, Any]] | None = None  # an environment's tool schemas (becomes Prompt.tools)

    @property
    def key(self) -> str:
        if self.messages is None:
            return self.text
        return json.dumps(self.messages, sort_keys=True, ensure_ascii=False)


@dataclass
class PromptData:
    """A data set cut into a train set and an eval set that share no prompt. `digest` identifies the data (a
    resumed run refuses other data); `dropped`: train rows left out because their prompt is in the eval set."""

    train: list[DataRow]
    eval: list[DataRow]
    digest: str
    dropped: int = 0


def load_prompt_data(cfg: DataConfig) -> PromptData:
    """Read, validate and split `cfg`'s rows (with no eval_* set: `default_eval_size` prompts held out)."""
    if cfg.eval_split is not None and cfg.path is not None and _format(cfg.path, cfg.format) != "disk":
        raise DataError(f"{cfg.path}: data.eval_split needs a dataset with splits (a DatasetDict directory or a hub "
                        "dataset); for a file use eval_path, eval_fraction or eval_size")
    rows = read_rows(cfg, cfg.path, cfg.split)
    if cfg.eval_path is not None or cfg.eval_split is not None:
        held = read_rows(cfg, cfg.eval_path or cfg.path, cfg.eval_split or cfg.split)
        eval_rows = _distinct(held)
    elif cfg.eval_fraction is not None:
        eval_rows = _distinct([r for r in rows if held_out_score(r.key) < cfg.eval_fraction])
    else:
        distinct = _distinct(rows)
        size = cfg.eval_size if cfg.eval_size is not None else default_eval_size(len(distinct))
        eval_rows = sorted(distinct, key=lambda r: held_out_score(r.key))[:size]
    keys = {r.key for r in eval_rows}
    train = [r for r in rows if r.key not in keys]
    if not train:
        raise DataError(f"{_name(cfg)}: no training rows left ({len(rows)} read, {len(rows) - len(train)} of them "
                        "share a prompt with the eval set)")
    eval_rows.sort(key=lambda r: held_out_score(r.key))  # a fixed order, whatever the file order
    return PromptData(train, eval_rows, _digest(train, eval_rows), dropped=len(rows) - len(train))


def default_eval_size(distinct_prompts: int) -> int:
    """Held out when no eval_* is set: a tenth of the distinct prompts, at most 64. Fixed by the data alone (not
    by run.eval_prompts, which a resumed run may change), so the train set never moves under a checkpoint."""
    return min(64, distinct_prompts // 10)


def held_out_score(key: str) -> float:
    """A stable number in [0, 1) for a prompt: the held-out split is every prompt scoring under a threshold."""
    digest = hashlib.sha256((_HELD_OUT_SALT + key).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def read_rows(cfg: DataConfig, path: str | None, split: str) -> list[DataRow]:
    """Every row of one file, directory or cached hub split, mapped and validated."""
    if path is None:
        assert cfg.hub is not None
        name, records = f"hub dataset {cfg.hub!r} split {split!r}", _hub_records(cfg, split)
    else:
        fmt = _format(path, cfg.format)
        name = path
        records = {"jsonl": _jsonl_records, "parquet": _parquet_records}[fmt](path) if fmt != "disk" \
            else _disk_records(path, split)
    try:
        rows = [to_row(record, cfg, name, number) for number, record in records]
    except IsADirectoryError:
        raise DataError(f"{name}: a directory, not a {cfg.format} file: give a file, or data.format: disk for a "
                        "`datasets.save_to_disk` directory") from None
    except OSError as e:
        raise DataError(f"{name}: cannot be read: {e.strerror or e}") from None
    if not rows:
        raise DataError(f"{name}: no rows (the data is empty): give a file with at least one row")
    return rows


def to_row(record: Any, cfg: DataConfig, file: str, row: int) -> DataRow:
    """One raw record mapped by `cfg`'s columns; a DataRowError names what is wrong and where."""
    if not isinstance(record, dict):
        raise DataRowError(file, row, None, f"expected an object with columns, got {type(record).__name__}")

    def column(name: str) -> Any:
        if name not in record:
            raise DataRowError(file, row, name, f"missing (the row has {', '.join(map(str, record)) or 'no columns'}): "
                               "fix the row, or map the columns with run.data's prompt, messages, answer, extra")
        return record[name]

    messages = None
    if cfg.messages is not None:
        messages = _messages(column(cfg.messages), file, row, cfg.messages)
        users = [m["content"] for m in messages if m["role"] == "user"]
        text = users[-1] if users else messages[-1]["content"]
    else:
        text = column(cfg.prompt_field)
        if not isinstance(text, str) or not text.strip():
            raise DataRowError(file, row, cfg.prompt_field, f"expected non-empty text, got {_show(text)}")
    answer = None
    if cfg.answer is not None:
        value = column(cfg.answer)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise DataRowError(file, row, cfg.answer, f"expected text or a number, got {_show(value)}")
        answer = None if value is None else str(value)
    extra = {}
    for name in cfg.extra:
        value = column(name)
        if not _json_like(value):
            raise DataRowError(file, row, name, f"a {type(value).__name__} cannot travel with a prompt (JSON "
                               "values only: text, numbers, booleans, lists, objects)")
        extra[name] = value
    return DataRow(text, answer, messages, extra, where=f"{file}, row {row}")


# ---- readers: (row number, record) pairs ---------------------------------------------------------------------


def _format(path: str, fmt: Format) -> Literal["jsonl", "parquet", "disk"]:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{path}: no such file or directory (data is read locally, never downloaded)")
    if fmt != "auto":
        return fmt
    if p.is_dir():
        return "disk"
    if p.suffix.lower() in _SUFFIXES:
        return _SUFFIXES[p.suffix.lower()]  # type: ignore[return-value]
    raise DataError(f"{path}: cannot tell the format from the suffix {p.suffix!r}; name it .jsonl or .parquet, "
                    "or set data.format (jsonl, parquet, disk)")


def _jsonl_records(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataRowError(path, number, None, "not UTF-8 text: is it a JSON Lines file? (a Parquet file is "
                                   "named .parquet, or set data.format)") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataRowError(path, number, None, f"not JSON: {e.msg} at column {e.colno}") from None


def _parquet_records(path: str) -> Iterator[tuple[int, Any]]:
    pq = _require("pyarrow.parquet", "pyarrow")
    import pyarrow

    try:
        file = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a Parquet file ({e}): give a JSON Lines file a .jsonl name, or set "
                        "data.format to the file's format (jsonl, parquet, disk)") from None
    number = 0
    for batch in file.iter_batches():
        for record in batch.to_pylist():
            number += 1
            yield number, record


def _disk_records(path: str, split: str) -> Iterator[tuple[int, Any]]:
    datasets = _require("datasets", "datasets")
    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise DataError(f"{path}: not a `datasets.save_to_disk` directory ({e})") from None
    yield from _split_records(loaded, split, path)


def _hub_records(cfg: DataConfig, split: str) -> Iterator[tuple[int, Any]]:
    datasets = _require("datasets", "datasets")
    with hub_offline():
        try:
            loaded = datasets.load_dataset(cfg.hub, cfg.hub_config, split=split, cache_dir=cfg.cache_dir)
        except (ConnectionError, FileNotFoundError) as e:
            raise DataError(f"hub dataset {cfg.hub!r} is not in the local datasets cache "
                            f"({cfg.cache_dir or 'HF_DATASETS_CACHE'}) and is never downloaded at run time: load it "
                            f"once beforehand, or save it with save_to_disk and set data.path ({e})") from None
        except ValueError as e:  # an unknown split
            raise DataError(f"hub dataset {cfg.hub!r}: {e}") from None
    yield from _split_records(loaded, split, f"hub dataset {cfg.hub!r}")


def _split_records(loaded: Any, split: str, name: str) -> Iterator[tuple[int, Any]]:
    if isinstance(loaded, dict):  # a DatasetDict (a Dataset is no mapping)
        if split not in loaded:
            raise DataError(f"{name}: no split {split!r} (it has {', '.join(loaded.keys())})")
        loaded = loaded[split]
    yield from enumerate(loaded, 1)


@contextmanager
def hub_offline() -> Iterator[None]:
    """Force the Hub offline for the block (environment and the already-imported libraries' flags), so a hub
    dataset can only come from the local cache; everything is put back afterwards."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    env = {k: os.environ.get(k) for k in names}
    os.environ.update(dict.fromkeys(names, "1"))
    flags = [(sys.modules[m], a) for m, a in (("huggingface_hub.constants", "HF_HUB_OFFLINE"),
                                             ("datasets.config", "HF_HUB_OFFLINE"),
                                             ("datasets.config", "HF_DATASETS_OFFLINE"))
             if m in sys.modules and hasattr(sys.modules[m], a)]
    saved = [getattr(m, a) for m, a in flags]
    for m, a in flags:
        setattr(m, a, True)
    try:
        yield
    finally:
        for (m, a), value in zip(flags, saved):
            setattr(m, a, value)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- helpers -------------------------------------------------------------------------------------------------


def _messages(value: Any, file: str, row: int, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataRowError(file, row, name, f"expected a non-empty list of {{role, content}}, got {_show(value)}")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataRowError(file, row, f"{name}[{i}]", f"expected {{role: text, content: text}}, got {_show(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _json_like(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_json_like(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    return False


def _distinct(rows: list[DataRow]) -> list[DataRow]:
    """The first row of each prompt (an eval set scores each prompt once)."""
    seen: dict[str, DataRow] = {}
    for r in rows:
        seen.setdefault(r.key, r)
    return list(seen.values())


def _digest(train: list[DataRow], eval_rows: list[DataRow]) -> str:
    h = hashlib.sha256()
    for part, rows in (("train", train), ("eval", eval_rows)):
        h.update(part.encode())
        for r in rows:
            h.update(json.dumps([r.key, r.answer, r.extra], sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()[:16]


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _name(cfg: DataConfig) -> str:
    return cfg.path or f"hub dataset {cfg.hub!r}"


def _require(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading this data needs {package}: pip install 'composer-mesh[data]'") from None
