"""Prompts from data (`run.data`) and the prompt sources: every format read back, the field mapping, malformed rows
named by file, row and field, per-epoch shuffles, held-out sets disjoint from training by construction, stream
state that resumes bit-exact, and hub datasets read from the local cache only. All data is written here."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.prompts import (
    DataPrompts,
    PromptSourceError,
    TaskPrompts,
    prompt_source,
)
from composer_mesh.tasks.arithmetic import AdditionTask
from composer_mesh.tasks.data import (
    DataConfig,
    DataError,
    DataRowError,
    held_out_score,
    hub_offline,
    load_prompt_data,
    read_rows,
)

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3} for a in range(10) for b in range(4)]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def data(path: Path, **kw: Any) -> DataConfig:
    return DataConfig(path=str(path), **kw)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every attempt to open a connection is recorded and refused."""
    attempts: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


# ---- formats and field mapping ---------------------------------------------------------------------------------


def test_jsonl_parquet_and_datasets_directories_read_back_the_same_rows(tmp_path: Path, no_network: list[Any]):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "flat"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(str(tmp_path / "dict"))
    sources = [write_jsonl(tmp_path / "d.jsonl", ROWS), write_parquet(tmp_path / "d.parquet", ROWS),
               tmp_path / "flat", tmp_path / "dict"]
    read = [read_rows(data(p, extra=["level"]), str(p), "train") for p in sources]
    assert len(read[0]) == len(ROWS)
    assert all(r == read[0] for r in read[1:])
    assert (read[0][5].text, read[0][5].answer, read[0][5].extra) == ("1+1=", "2", {"level": 1})
    assert [r.text for r in read_rows(data(tmp_path / "dict"), str(tmp_path / "dict"), "test")] == ["0+0=", "0+1=", "0+2="]
    with pytest.raises(DataError, match=r"no split 'validation' \(it has train, test\)"):
        read_rows(data(tmp_path / "dict"), str(tmp_path / "dict"), "validation")
    assert not no_network


def test_format_comes_from_the_suffix_or_is_named(tmp_path: Path):
    odd = write_jsonl(tmp_path / "prompts.txt", ROWS[:2])
    with pytest.raises(DataError, match=r"cannot tell the format from the suffix '\.txt'"):
        load_prompt_data(data(odd))
    assert len(load_prompt_data(data(odd, format="jsonl", eval_size=1)).train) == 1
    with pytest.raises(DataError, match="no such file or directory"):
        load_prompt_data(data(tmp_path / "missing.jsonl"))


def test_field_mapping_renames_columns_carries_extras_and_chat_messages(tmp_path: Path):
    rows = [{"question": f"{i}+1=", "solution": i + 1, "meta": {"src": "gen", "tags": ["a"]}, "id": i}
            for i in range(20)]
    cfg = data(write_jsonl(tmp_path / "q.jsonl", rows), prompt="question", answer="solution", extra=["meta", "id"],
               eval_size=2)
    source = DataPrompts(load_prompt_data(cfg), seed=0)
    p = source.take(1)[0]
    i = int(p.text.split("+")[0])
    assert (p.prompt_id, p.answer, p.extra, p.messages) == ("p0", str(i + 1), {"meta": {"src": "gen", "tags": ["a"]}, "id": i}, None)

    chats = [{"chat": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+2="}], "answer": str(i + 2)}
             for i in range(20)]
    cfg = data(write_parquet(tmp_path / "c.parquet", chats), messages="chat", eval_size=2)
    p = DataPrompts(load_prompt_data(cfg), seed=0).take(1)[0]
    assert p.messages is not None and p.messages[0] == {"role": "system", "content": "Add."}
    assert p.text == p.messages[-1]["content"]  # the last user message is the prompt text rewards see
    no_answers = load_prompt_data(data(tmp_path / "q.jsonl", prompt="question", answer=None, eval_size=0))
    assert {r.answer for r in no_answers.train} == {None}


def test_config_refuses_ambiguous_settings():
    with pytest.raises(ValidationError, match="exactly one of `path`"):
        DataConfig()
    with pytest.raises(ValidationError, match="exactly one of `path`"):
        DataConfig(path="a.jsonl", hub="org/name")
    with pytest.raises(ValidationError, match="not both"):
        DataConfig(path="a.jsonl", prompt="q", messages="chat")
    with pytest.raises(ValidationError, match="eval_path and eval_fraction both choose the eval set"):
        DataConfig(path="a.jsonl", eval_path="b.jsonl", eval_fraction=0.1)
    with pytest.raises(ValidationError, match="repeats the column"):
        DataConfig(path="a.jsonl", extra=["answer"])
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DataConfig(path="a.jsonl", colums=["x"])
    with pytest.raises(ValidationError, match=r"run.task \('pkg.mod:Mine'\) and run.data are two prompt sources"):
        RunConfig(task="pkg.mod:Mine", data={"path": "a.jsonl"})
    run = RunConfig(task="addition", data={"path": "a.jsonl", "eval_fraction": 0.1})  # the default task, as a
    assert run.data is not None and run.data.prompt_field == "prompt"  # re-validated section (`--steps`) has it


# ---- malformed rows --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, kw, row, field, problem", [
    ('{"prompt": "1+1=", "answer": "2"', {}, 3, None, "not JSON"),
    ('["1+1=", "2"]', {}, 3, None, "expected an object with columns, got list"),
    ({"answer": "2"}, {}, 3, "prompt", r"missing \(the row has answer\)"),
    ({"prompt": "", "answer": "2"}, {}, 3, "prompt", "expected non-empty text, got str ''"),
    ({"prompt": "1+1=", "answer": ["2"]}, {}, 3, "answer", "expected text or a number, got list"),
    ({"prompt": "1+1=", "answer": "2"}, {"extra": ["level"]}, 3, "level", "missing"),
    ({"chat": [{"role": "user"}], "answer": "2"}, {"messages": "chat"}, 3, "chat[0]", "expected {role: text"),
    ({"chat": "1+1=", "answer": "2"}, {"messages": "chat"}, 3, "chat", "expected a non-empty list"),
])
def test_a_malformed_row_is_named_by_file_row_and_field(tmp_path: Path, bad, kw, row, field, problem):
    good = ({"chat": [{"role": "user", "content": "1+1="}], "answer": "2", "level": 1} if "messages" in kw
            else {"prompt": "1+1=", "answer": "2", "level": 1})
    path = write_jsonl(tmp_path / "rows.jsonl", [good, "", bad, good])  # line 2 is blank: rows are counted as lines
    with pytest.raises(DataRowError, match=problem) as e:
        load_prompt_data(data(path, **kw))
    assert (e.value.file, e.value.row, e.value.field) == (str(path), row, field)
    assert str(e.value).startswith(f"{path}, row {row}" + (f", field {field!r}" if field else ""))


def test_a_value_that_cannot_travel_with_a_prompt_is_named(tmp_path: Path):
    rows = [{"prompt": "1+1=", "answer": "2", "when": datetime(2024, 1, 1)}] * 3
    path = write_parquet(tmp_path / "t.parquet", rows)
    with pytest.raises(DataRowError, match=r"t\.parquet, row 1, field 'when': a datetime cannot travel"):
        load_prompt_data(data(path, extra=["when"]))


# ---- the train stream and the eval set -------------------------------------------------------------------------


def stream_texts(source: DataPrompts, n: int) -> list[str]:
    return [p.text for p in source.take(n)]


def test_each_epoch_is_a_seeded_shuffle_of_every_train_row(tmp_path: Path):
    prompts = load_prompt_data(data(write_jsonl(tmp_path / "d.jsonl", ROWS), eval_size=4))
    n = len(prompts.train)
    a = stream_texts(DataPrompts(prompts, seed=3), 3 * n)
    epochs = [a[i * n:(i + 1) * n] for i in range(3)]
    assert all(sorted(e) == sorted(r.text for r in prompts.train) for e in epochs)  # each row once per epoch
    assert epochs[0] != epochs[1] != epochs[2]
    assert a == stream_texts(DataPrompts(prompts, seed=3), 3 * n)  # the same seed: the same stream
    assert a[:n] != stream_texts(DataPrompts(prompts, seed=4), n)
    ids = [p.prompt_id for p in DataPrompts(prompts, seed=3).take(n + 2)]
    assert ids == [f"p{i}" for i in range(n + 2)]  # ids count on across epochs


@pytest.mark.parametrize("kw, size", [({"eval_fraction": 0.2}, None), ({"eval_size": 7}, 7), ({}, len(ROWS) // 10)])
def test_held_out_prompts_never_reach_the_train_stream(tmp_path: Path, kw: dict[str, Any], size: int | None):
    rows = ROWS + ROWS[:10]  # duplicated prompts land on one side only
    prompts = load_prompt_data(data(write_jsonl(tmp_path / "d.jsonl", rows), **kw))
    source = DataPrompts(prompts, seed=0)
    held = {p.text for p in source.eval_prompts(100)}
    assert held and (size is None or len(held) == size)  # with no eval_*: a tenth of the prompts
    trained = stream_texts(source, 4 * len(prompts.train))  # four epochs
    assert not held & set(trained)
    assert held | set(trained) == {r["prompt"] for r in ROWS}  # nothing else lost
    # The held-out set is a function of the prompts, not of their order or the seed.
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    again = load_prompt_data(data(write_jsonl(tmp_path / "s.jsonl", shuffled), seed=9, **kw))
    assert [r.text for r in again.eval] == [r.text for r in prompts.eval]
    assert [p.prompt_id for p in source.eval_prompts(3)] == ["eval0", "eval1", "eval2"]


def test_a_separate_eval_file_or_split_is_taken_out_of_training(tmp_path: Path):
    import datasets

    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    prompts = load_prompt_data(data(train, eval_path=str(write_jsonl(tmp_path / "eval.jsonl", ROWS[:5] + ROWS[:2]))))
    assert [r.text for r in prompts.train] == [r["prompt"] for r in ROWS[5:]] and prompts.dropped == 5
    assert sorted(r.text for r in prompts.eval) == sorted(r["prompt"] for r in ROWS[:5])  # each prompt once
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[-3:])}).save_to_disk(str(tmp_path / "dict"))
    split = load_prompt_data(data(tmp_path / "dict", eval_split="test"))
    assert len(split.train) == len(ROWS) - 3 and {r.text for r in split.eval} == {r["prompt"] for r in ROWS[-3:]}
    with pytest.raises(DataError, match="eval_split needs a dataset with splits"):
        load_prompt_data(data(train, eval_split="test"))
    with pytest.raises(DataError, match="no training rows left"):
        load_prompt_data(data(train, eval_path=str(train)))


def test_stream_state_restores_bit_exact_through_json(tmp_path: Path):
    prompts = load_prompt_data(data(write_jsonl(tmp_path / "d.jsonl", ROWS), eval_size=4, extra=["level"]))
    for make in (lambda: DataPrompts(prompts, seed=5), lambda: TaskPrompts("addition", seed=5)):
        whole = make()
        expected = whole.take(50)
        cut = make()
        first = cut.take(23)
        resumed = make()
        resumed.restore(json.loads(json.dumps(cut.state())))
        assert first + resumed.take(27) == expected
        assert resumed.count == 50
    other = load_prompt_data(data(write_jsonl(tmp_path / "e.jsonl", ROWS[1:]), eval_size=4))
    with pytest.raises(PromptSourceError, match="prompt data differs"):
        DataPrompts(other, seed=5).restore(DataPrompts(prompts, seed=5).state())
    with pytest.raises(PromptSourceError, match="a 'task' source, this run's is a 'data' source"):
        DataPrompts(prompts, seed=5).restore(TaskPrompts("addition", seed=5).state())


# ---- task sources ----------------------------------------------------------------------------------------------


class NoSplits:
    """A user task from before splits: `sample(rng)` only."""

    name = "nosplits"
    alphabet = "0123456789+="

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a = rng.randint(0, 9)
        return f"{a}+0=", str(a)

    def reward(self, prompt: str, completion: str, answer: str | None) -> float:
        return float(completion == answer)


def test_a_task_source_trains_and_evaluates_on_disjoint_splits():
    source = TaskPrompts("addition", seed=0)
    trained = {p.text for p in source.take(500)}
    held = source.eval_prompts(40)
    assert [p.prompt_id for p in held[:2]] == ["eval0", "eval1"]
    assert held == source.eval_prompts(40)  # the same prompts every evaluation
    assert not trained & {p.text for p in held}


def test_a_task_listing_its_eval_split_scores_each_held_out_problem_once():
    """Addition lists its 20 held-out problems: asking for more gives each once (an accuracy counts every problem
    with the same weight), asking for fewer gives a seeded subset, and none is ever a training problem."""
    task = AdditionTask()
    held_out = {f"{a}+{b}=" for a, b in task.pairs["eval"]}
    source = TaskPrompts("addition", seed=3)
    texts = [p.text for p in source.eval_prompts(64)]
    assert sorted(texts) == sorted(held_out)  # all 20, no repeats
    assert all(p.answer == str(sum(map(int, p.text[:-1].split("+")))) for p in source.eval_prompts(64))
    assert [p.text for p in source.eval_prompts(5)] == texts[:5]
    assert [p.text for p in TaskPrompts("addition", seed=4).eval_prompts(64)] != texts  # the order follows the seed
    assert not {p.text for p in source.take(2000)} & held_out
    with pytest.raises(ValueError, match="splits"):
        task.problems("test")


def test_a_task_without_splits_trains_but_refuses_an_eval():
    source = TaskPrompts(NoSplits(), seed=0)
    assert [p.text for p in source.take(2)] == [NoSplits().sample(r)[0] for r in [random.Random(0)] for _ in range(2)]
    assert source.eval_prompts(0) == []
    with pytest.raises(PromptSourceError, match="task 'nosplits' has no eval split"):
        source.eval_prompts(4)
    with pytest.raises(PromptSourceError, match=r"run\.eval_prompts: 0"):
        prompt_source(RunConfig(task=f"{__name__}:NoSplits", eval_prompts=4))
    assert prompt_source(RunConfig(task=f"{__name__}:NoSplits", eval_prompts=0)).take(1)[0].prompt_id == "p0"


def test_the_run_picks_data_over_the_task(tmp_path: Path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    source = prompt_source(RunConfig(seed=2, eval_prompts=8, data={"path": str(path), "eval_size": 8}))
    assert isinstance(source, DataPrompts) and source.seed == 2 and len(source.eval_prompts(8)) == 8
    with pytest.raises(PromptSourceError, match=r"run\.data has no eval rows"):
        prompt_source(RunConfig(eval_prompts=8, data={"path": str(path), "eval_size": 0}))
    assert prompt_source(RunConfig(eval_prompts=0, data={"path": str(path), "eval_size": 0, "seed": 7})).seed == 7


# ---- hub datasets: the local cache only ------------------------------------------------------------------------


def cache_hub_dataset(tmp_path: Path, name: str, rows: list[dict[str, Any]]) -> Path:
    """A `datasets` cache holding `name` as `load_dataset(name)` leaves it after a download (built locally)."""
    import datasets

    build = tmp_path / "build"
    with hub_offline():
        datasets.load_dataset("json", data_files={"train": str(write_jsonl(tmp_path / "src.jsonl", rows))},
                              cache_dir=str(build))
    built = next(build.glob("json/*/*/*/dataset_info.json")).parent
    org, short = name.split("/")
    dest = tmp_path / "cache" / f"{org}___{short}" / "default" / "0.0.0" / "0"
    dest.mkdir(parents=True)
    shutil.copy(built / "dataset_info.json", dest)
    shutil.copy(built / "json-train.arrow", dest / f"{short}-train.arrow")
    return tmp_path / "cache"


def test_a_cached_hub_dataset_is_read_offline_and_a_missing_one_is_never_fetched(
        tmp_path: Path, no_network: list[Any], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cache = cache_hub_dataset(tmp_path, "someorg/addition", ROWS)
    prompts = load_prompt_data(DataConfig(hub="someorg/addition", cache_dir=str(cache), eval_size=4))
    assert len(prompts.train) == len(ROWS) - 4 and prompts.train[0].answer is not None
    with pytest.raises(DataError, match="'someorg/other' is not in the local datasets cache"):
        load_prompt_data(DataConfig(hub="someorg/other", cache_dir=str(cache)))
    assert not no_network
    assert "HF_HUB_OFFLINE" not in os.environ  # put back as it was


def test_hub_offline_forces_every_flag_and_restores_them(monkeypatch: pytest.MonkeyPatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    before = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    with hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert huggingface_hub.constants.HF_HUB_OFFLINE is True and datasets.config.HF_HUB_OFFLINE is True
    assert os.environ["HF_HUB_OFFLINE"] == "0"
    assert before == (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)


def test_held_out_score_is_stable():
    # A fixed function of the prompt (sha256): the same split on every machine and Python version.
    assert held_out_score("1+2=") == held_out_score("1+2=") != held_out_score("2+1=")
    assert 0 <= held_out_score("") < 1
