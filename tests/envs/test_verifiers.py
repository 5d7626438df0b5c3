"""verifiers 0.4 as a run's environment, with the real library (no fakes): the shipped taskset
(composer_mesh/envs/addition_taskset.py, named by its module path; docs/verifiers.md shows it) and tasksets of our
own (top-level modules written to a temporary directory on the path, as installed taskset packages are): prompts
are the taskset's tasks, train and eval share no prompt, the task's own rewards score completions through
`Task.score` (also in the `python` rewarder's worker processes), the stream survives a checkpoint, and the
shipped topology runs a few steps with every loss channel."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from composer_mesh.envs.base import EnvironmentStateError
from composer_mesh.envs.verifiers import VerifiersConfig, VerifiersEnvironment, score
from composer_mesh.orchestration.prompts import EnvironmentPrompts
from composer_mesh.tasks.arithmetic import AdditionTask
from envs.e2e import run_every_channel, scores_in_workers, shortened

pytest.importorskip("verifiers", reason="verifiers 0.4 needs Python >= 3.11 (the test extra installs it there)")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "verifiers.md"
TOPOLOGY = ROOT / "topologies" / "verifiers.yaml"
SHIPPED = "composer_mesh.envs.addition_taskset"  # the example taskset, by its module path

# Chat prompts with a system prompt, two weighted rewards, a metric, and a reward that needs a runtime.
CHAT_SUMS = '''
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 2)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))

    @vf.reward
    async def in_sandbox(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class ChatSumsConfig(vf.TasksetConfig):
    split: str = "train"  # "train": operands 0..5, "test": 4..7 (four problems in both)
    repeat: bool = False  # the first problem twice


class ChatSums(vf.Taskset[SumTask, ChatSumsConfig]):
    def load(self):
        low, high = (0, 6) if self.config.split == "train" else (4, 8)
        pairs = [(a, b) for a in range(low, high) for b in range(low, high)]
        for a, b in pairs + pairs[:1] * self.config.repeat:
            prompt = [vf.UserMessage(content=f"What is {a} plus {b}?")]
            data = SumData(prompt=prompt, system_prompt="Reply with the number only.", answer=str(a + b))
            yield SumTask(data, self.config.task)


__all__ = ["ChatSums"]
'''

SANDBOXED = '''
import verifiers.v1 as vf


class ToolTask(vf.Task[vf.TaskData, vf.State]):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class Sandboxed(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        for i in range(20):
            yield ToolTask(vf.TaskData(prompt=f"Fix bug {i}."), self.config.task)


__all__ = ["Sandboxed"]
'''

ENDLESS = '''
import itertools

import verifiers.v1 as vf


class Endless(vf.Taskset[vf.Task, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        for i in itertools.count():
            yield vf.Task(vf.TaskData(prompt=f"Count to {i}."), self.config.task)


__all__ = ["Endless"]
'''


def test_the_docs_show_the_shipped_taskset() -> None:
    """docs/verifiers.md's block after `<!-- taskset: composer_mesh/envs/addition_taskset.py -->` is that file."""
    path = "composer_mesh/envs/addition_taskset.py"
    match = re.search(rf"<!-- taskset: {path} -->\n```python\n(.*?)```", DOCS.read_text(), re.S)
    assert match, "docs/verifiers.md lost its taskset block"
    assert match.group(1) == (ROOT / path).read_text(), f"docs/verifiers.md shows another taskset than {path}"


@pytest.fixture(scope="module", autouse=True)
def tasksets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Our test tasksets as top-level modules on the path (the reward workers inherit it)."""
    where = tmp_path_factory.mktemp("tasksets")
    for name, source in {"chat_sums": CHAT_SUMS, "sandboxed_sums": SANDBOXED, "endless_sums": ENDLESS}.items():
        (where / f"{name}.py").write_text(source)
    sys.path.insert(0, str(where))
    yield where
    sys.path.remove(str(where))


def environment(taskset: str = "chat_sums", seed: int = 0, **fields: object) -> VerifiersEnvironment:
    return VerifiersEnvironment(VerifiersConfig.model_validate({"kind": "verifiers", "taskset": taskset, **fields}),
                                seed)


def test_the_shipped_taskset_as_the_tiny_models_prompts() -> None:
    env = environment(SHIPPED, eval_taskset_config={"split": "eval"}, chat=False)
    src = EnvironmentPrompts(env)
    pairs = AdditionTask().pairs  # the taskset's eval split is the addition task's held-out fifth
    assert {p.text for p in src.eval_prompts(20)} == {f"{a}+{b}=" for a, b in pairs["eval"]}
    prompts = src.take(80)  # one epoch: every train task once
    assert {p.text for p in prompts} == {f"{a}+{b}=" for a, b in pairs["train"]}
    assert [p.prompt_id for p in prompts[:3]] == ["p0", "p1", "p2"]
    p = prompts[0]
    a, b = p.text.rstrip("=").split("+")
    assert p.messages is None and p.answer == str(int(a) + int(b))  # chat: false: a model without a template
    assert score(p.text, f"{p.answer};", p.answer, p.extra) == 1.0
    assert score(p.text, f"{int(p.answer) + 1};", p.answer, p.extra) == 0.0


def test_chat_prompts_carry_the_tasks_messages_and_data() -> None:
    row = environment().train_rows(1)[0]
    a, b = map(int, re.findall(r"\d", row.text))
    assert row.messages == [{"role": "system", "content": "Reply with the number only."},
                            {"role": "user", "content": f"What is {a} plus {b}?"}]
    assert row.text == f"What is {a} plus {b}?" and row.answer == str(a + b)
    where = row.extra["verifiers"]
    assert where["env"] == {"id": "", "taskset": {"id": "chat_sums"}}
    assert where["task"]["answer"] == row.answer and where["task"]["prompt"][0]["content"] == row.text
    assert json.loads(json.dumps(row.extra)) == row.extra  # crosses to the reward workers as JSON


def test_the_tasks_own_rewards_score_weighted() -> None:
    row = environment().train_rows(1)[0]
    assert row.answer is not None
    assert score(row.text, row.answer, row.answer, row.extra) == 1.5  # correct + 0.5 × brief
    assert score(row.text, f"It is {row.answer}.", row.answer, row.extra) == 0.0
    assert score(row.text, "99", row.answer, row.extra) == 0.5  # brief, not correct
    with pytest.raises(ValueError, match="no extra"):
        score(row.text, row.answer, row.answer, {})


def test_a_task_with_only_runtime_rewards_cannot_be_scored_offline() -> None:
    row = environment("sandboxed_sums").train_rows(1)[0]
    with pytest.raises(ValueError, match=r"recorded no reward .* \['tests_pass'\] need a runtime"):
        score(row.text, "done", None, row.extra)


def test_python_rewarder_scores_with_the_library_in_its_workers() -> None:

    prompt = EnvironmentPrompts(environment()).take(1)[0]
    assert prompt.answer is not None
    texts = (prompt.answer, "99", "no idea")
    assert scores_in_workers(prompt, texts, "composer_mesh.envs.verifiers:score") == [1.5, 0.5, 0.0]


def test_train_and_eval_share_no_prompt() -> None:
    # Held out by hash: the same set whatever the order, and a prompt that occurs twice is on one side only.
    env = environment(taskset_config={"repeat": True}, eval_size=5)
    eval_texts = [r.text for r in env.eval_rows(5)]
    train_texts = [r.text for r in env.train_rows(len(env.train))]  # one epoch
    assert len(set(eval_texts)) == 5 and not set(train_texts) & set(eval_texts)
    assert len(train_texts) + len(eval_texts) + env.dropped == 37 and len(set(train_texts)) == 31
    assert [r.text for r in environment(taskset_config={"repeat": True}, eval_size=5, seed=9).eval_rows(5)] \
        == eval_texts
    # A test split of the same taskset: its four problems that are also train problems leave training.
    split = environment(eval_taskset_config={"split": "test"})
    eval_split = {r.text for r in split.eval_rows(100)}
    assert len(eval_split) == 16 and split.dropped == 4 and len(split.train) == 32
    assert not {r.text for r in split.train} & eval_split


def test_state_restores_the_stream_and_refuses_another_environment() -> None:
    a = environment(eval_size=4)
    a.train_rows(40)  # past the first epoch (32 tasks)
    state = json.loads(json.dumps(a.state()))  # as in controller.json
    b = environment(eval_size=4)
    b.restore(state)
    assert [r.text for r in b.train_rows(20)] == [r.text for r in a.train_rows(20)]
    with pytest.raises(EnvironmentStateError, match="the seed, the taskset or verifiers changed"):
        environment(eval_size=4, seed=1).restore(state)


def test_config_errors_are_named() -> None:
    with pytest.raises(ValidationError, match="eval_taskset_config and eval_size both choose the eval set"):
        VerifiersConfig(kind="verifiers", taskset="chat_sums", eval_size=3, eval_taskset_config={"split": "test"})
    with pytest.raises(ValidationError, match=r"name the taskset in run\.environment\.taskset"):
        VerifiersConfig(kind="verifiers", taskset="chat_sums", taskset_config={"id": "other"})
    with pytest.raises(ValueError, match=r"verifiers cannot load the environment .*no_such_taskset.* not found"):
        environment("no_such_taskset")
    with pytest.raises(ValueError, match=r"cannot load .*ModuleNotFoundError: No module named 'composer_mesh.nope'"):
        environment("composer_mesh.nope.taskset")
    with pytest.raises(ValueError, match=r"taskset 'endless_sums' is infinite: set run.environment.limit"):
        environment("endless_sums")
    assert len(environment("endless_sums", limit=30).train) == 27  # 3 of 30 held out
    with pytest.raises(ValueError, match=r"has 2 prompt messages .* set run\.environment\.chat: true"):
        environment(chat=False)


def test_the_shipped_topology_names_the_shipped_taskset() -> None:
    from composer_mesh.topology import load_topology

    data = yaml.safe_load(TOPOLOGY.read_text())
    env = VerifiersConfig.model_validate(data["run"]["environment"])
    assert env.taskset == SHIPPED and env.eval_taskset_config == {"split": "eval"} and not env.chat
    assert data["roles"]["rewarder"]["settings"]["functions"][0]["path"] == "composer_mesh.envs.verifiers:score"
    assert data["model"]["warmstart"]["task"] == "addition"  # trains on the train split only: eval stays unseen
    assert load_topology(TOPOLOGY).run.environment == env


@pytest.mark.e2e  # a shipped topology run end to end: its own tier (`pytest -m e2e`), run by .ci/run
async def test_a_few_steps_on_cpu_with_every_loss_channel(tmp_path: Path) -> None:
    """The shipped topology, shortened, on real local Monarch meshes: the shipped taskset loads by its module
    path in the controller and in the reward workers."""
    data = shortened(TOPOLOGY, tmp_path)
    data["model"]["warmstart"].update(steps=10, batch_size=16)
    # The teacher's own model, warm-started as the shipped policy is (~35% right; the default teacher trains 150
    # steps): right on some of the 24 prompts where the 10-step policy is not, so channel 3 gets pairs.
    teacher = {"source": "tiny", "task": "addition", "seed": 1, "warmstart": {"task": "addition", "steps": 40}}
    data["roles"]["teachers"]["members"][0]["settings"] = {"model": teacher}
    await run_every_channel(data, TOPOLOGY)
