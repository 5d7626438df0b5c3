"""A hosted teacher plays the calculator task as replay episodes: the multi-turn driver with the real calculator
environment, the tiny byte-tokenizer student as its generator (random weights, built in a second), and a real
teacher pool whose `openrouter` member talks HTTP to the fake OpenRouter, which solves the task with its tool.

What is checked: the teacher's episode is played at the message level (its tool call reaches the environment, the
tool's result goes back as a tool message answering the call's id) and comes back as a trace in the student's
tokens: its opening is the student's, its turns are the teacher's call and answer (trained on) around the
environment's tool result (not trained on), its reward is the environment's; what it cost, as the fake reported
it, is in the step's metrics per episode; the hosted teacher is no longer `unplayable`."""

from __future__ import annotations

import random
from typing import Any

import pytest
from orchestration.test_multi_turn import run_chunks

from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
from composer_mesh.actors.backends.teachers.openrouter import OpenRouterTeacher
from composer_mesh.actors.backends.teachers.openrouter_client import OpenRouterSettings
from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RolloutGroup,
    TeacherRequest,
    TeacherSignals,
)
from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool
from composer_mesh.envs.calculator import CalculatorEnvironment
from composer_mesh.envs.config import CalculatorConfig
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.tokenizer import build_byte_tokenizer
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.episode_metrics import teacher_episode_metrics
from composer_mesh.orchestration.schedule import Chunk
from tests.actors.backends.teachers.openrouter.fake_openrouter import FakeOpenRouter, serving

KEY = "sk-or-v1-TEST-driver-42"
ENV = "COMPOSER_MESH_TEST_OR_DRIVER_KEY"
MODEL = ModelConfig(tokenizer="byte", max_position_embeddings=512)


class StudentGenerators:
    """`ports.Generators` over one in-process tiny generator (the student: it renders turns with its template)."""

    n = 1

    def __init__(self) -> None:
        self.generator = HFGenerator(HFGeneratorSettings(stop_at_task_eos=False))
        self.generator.start(MODEL)

    def __len__(self) -> int:
        return 1

    async def generate(self, index: int, request: GenerationRequest) -> list[RolloutGroup]:
        return self.generator.generate(request, 0)

    async def generate_versioned(self, index: int, request: GenerationRequest) -> tuple[int, list[RolloutGroup]]:
        return 0, self.generator.generate(request, 0)


class PoolTeachers:
    """`ports.Teachers` over one in-process teacher pool (one proc)."""

    def __init__(self, pool: TeacherPool) -> None:
        self.pool = pool

    async def signals(self, request: TeacherRequest) -> list[TeacherSignals]:
        return [await self.pool.signals(request)]


@pytest.fixture(scope="module")
def fake() -> Any:
    with serving(KEY) as server:
        yield server


def calculator_prompts(env: CalculatorEnvironment, n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", row.text, answer=row.answer, messages=row.messages, extra=row.extra, tools=row.tools)
            for i, row in enumerate(env.train_rows(n))]


async def test_a_hosted_teacher_plays_the_calculator_task_in_the_students_tokens_and_its_cost_is_in_the_metrics(
        fake: FakeOpenRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, KEY)
    tok = build_byte_tokenizer()
    hosted = OpenRouterTeacher(OpenRouterSettings(base_url=fake.base_url, models=["fake/tools"], api_key_env=ENV),
                               rng=random.Random(0))
    pool = TeacherPool([PoolMember("hosted", frozenset({"replay"}), hosted)])
    pool.start(tok)
    env = CalculatorEnvironment(CalculatorConfig(kind="calculator"), seed=0)
    run = RunConfig(samples_per_prompt=2, max_new_tokens=8, seed=3, rollout={"kind": "multi_turn", "max_turns": 2},
                    environment={"kind": "calculator"})
    source = await run_chunks(StudentGenerators(), env, [Chunk(1, 0, calculator_prompts(env, 2))],  # type: ignore[arg-type]
                              PoolTeachers(pool), run)
    results = source.finished[0]
    traces = [t for r in results for t in r.traces]
    for r in results:
        [trace] = r.traces
        product = r.group.group.prompt.answer
        assert trace.teacher == "hosted" and trace.reward == 1.0  # the environment graded the teacher's answer
        assert trace.prompt_ids == r.group.group.rollouts[0].prompt_ids  # the student's opening ids
        spans = [(t.policy, tok.decode(trace.completion_ids[t.start:t.end])) for t in trace.turns or []]
        expression = r.group.group.prompt.text
        assert spans == [
            (True, f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
                   "<|im_end|>"),
            (False, f"\n<|im_start|>tool\n{product}<|im_end|>\n<|im_start|>assistant\n"),  # the environment's
            (True, f"{product}<|im_end|>"),
        ]
        # the tool's result went back to the teacher as a tool message answering its call
        asked = [q for q in fake.requests if q["messages"][-1].get("role") == "tool"
                 and q["messages"][-1]["content"] == product]
        assert asked and asked[0]["messages"][-1]["tool_call_id"] == "call_0"
    paid = sum(b["usage"]["cost"] for b in fake.responses)
    assert sum(t.usage["cost"] for t in traces) == pytest.approx(paid) and paid > 0
    metrics = teacher_episode_metrics(traces)  # what the step's record gets (StepRecorder)
    assert metrics["teacher_episodes/episodes/hosted"] == 2
    assert metrics["teacher_episodes/cost_usd/hosted"] == pytest.approx(paid)
    assert metrics["teacher_episodes/cost_per_episode_usd/hosted"] == pytest.approx(paid / 2)
    assert metrics["teacher_episodes/tokens_per_episode/hosted"] == pytest.approx(
        sum(b["usage"]["total_tokens"] for b in fake.responses) / 2)
