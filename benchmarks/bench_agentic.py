"""Agentic episodes: episodes/s and trainer idle fraction with simulated tool latency, composer-mesh vs TRL's
`GRPOTrainer(tools=... / environment_factory=...)` on the same task, model, batch and turns (issue 26).

The task: calculator tool use. The user message is a product such as `47*83`; the one tool is
`calculator(expression: str) -> str`; reward 1 when the final answer equals the product. Every tool call sleeps
`latency` seconds first (0, 100 ms, 1 s by default), standing in for a sandbox, a search backend or a test run.
composer-mesh plays it as `run.environment: {kind: calculator, min_digits: 2, max_digits: 2, tool_latency_s}`
(an asyncio sleep per call); TRL gets the same function (`composer_mesh.envs.calculator.calculator`, its docstring
and so its JSON schema) wrapped in a sleep (`calculator_tool`, `CalculatorEnv`), and 2-digit problems drawn by
`CalculatorTask.sample`.

Same turns on both sides: a scripted policy. The tiny model (built-in tiny Qwen2, byte tokenizer, random weights)
cannot call a tool by itself, and a benchmark of throughput needs every episode to make the same calls. So
generation is forced, token by token: on TRL's side by a `transformers` logits processor (`ScriptedTurns`)
that wraps `model.generate`, on composer-mesh's by a generator binding named by import path
(`ScriptedGenerator`: the hf generator whose KV-cache decode loop feeds the script's tokens instead of draws,
recording the model's own log-probs of them). While the
conversation holds fewer than `--tool-calls` tool results the assistant turn is the Qwen tool call
`<tool_call>\\n{"name": "calculator", "arguments": {"expression": "47*83"}}\\n</tool_call><|im_end|>`, after that
it is the last tool result followed by `<|im_end|>`. The model still runs its full forward for every token on
both sides (the processor only masks the logits it returns; tested token for token against each other in
tests/test_benchmarks.py), the trainer trains on those tokens as usual, and every episode has
exactly `--tool-calls` tool calls and `--tool-calls + 1` assistant turns (checked: the table prints tool calls
per episode and the mean reward, which must be 1). With all rewards equal GRPO's advantages are 0: the loss and
its backward still run in full, which is all a throughput benchmark needs.

Model and tokenizer, built offline once per run into OUT/model and loaded by both sides: the tiny Qwen2 (seed 0,
hidden 64, 2 layers, max 2048 positions: the tool prompt is ~810 byte tokens) with
`composer_mesh.models.tokenizer.build_byte_tokenizer()`, its chat template replaced by the installed TRL's
`chat_templates/qwen2_5.jinja` (TRL recognises a tool-calling template by its exact text, so it can parse the
calls) and its EOS set to `<|im_end|>` as Qwen2.5-Instruct's is (TRL cuts the tool-result suffix at the EOS).
Generation stops at `<|endoftext|>` or `<|im_end|>` (generation_config).

TRL side, one child process running the latencies in order, the modes interleaved per latency (a fresh model and
trainer each, after one untimed
warm-up step so the first latency measured does not pay the process's first-call costs):
`GRPOConfig(per_device_train_batch_size=prompts x samples, num_generations=samples, gradient_accumulation_steps=1,
num_iterations=1, max_steps=steps, max_tool_calling_iterations=tool_calls, max_completion_length=<what the
scripted episode needs>, temperature 1, beta 0, loss_type dapo, lr 1e-6, fp32, use_cpu, no vLLM)`. TRL modes
(`--trl-modes`): `tools` (a plain function `calculator(expression)` that `time.sleep`s), `async_tools` (the same
as a coroutine that `asyncio.sleep`s: TRL gathers one sample's calls, the samples still run one after another)
and `environment` (`environment_factory=CalculatorEnv`: `reset(**row)`, the tool as a method, `get_reward`).
TRL's `_tool_call_loop` runs the tools of a batch sample by sample, so each step waits batch x tool_calls x
latency on the tools.

Measured per (side, latency), side by side in one invocation:
- episodes/s = episodes completed (rollouts scored) / wall seconds from the first step's begin to the last step's
  end (generation, tools, scoring and training all inside; startup outside). TRL: a `TrainerCallback`.
- trainer idle = share of that window the optimizer is not computing. TRL generates inside its training step, so
  idle = time in `_generate_and_score_completions` (generation, tools, rewards) / window, timed by a subclass;
  also split into tool seconds (timed inside the tool) and `model.generate` seconds. composer-mesh: the steps'
  `timing.trainer_idle_s` (metrics.jsonl) / the same window.
- composer-mesh: `run_ours(latency_s, cfg)` runs `ours_topology_yaml` with `composer-mesh run` (one hf trainer,
  one `ScriptedGenerator`, local meshes, the multi-turn driver with `max_episodes` = every admitted step's
  episodes, `max_policy_lag: --lag` (3), GRPO only) and reads its metrics.jsonl (`summarise_ours`). Its window
  starts at the `train_start` event (the generators start after it), so step 1 includes the pipeline fill; the
  table also shows episodes/s and idle after step 1 (steady state), which the goals judge (`steady`).

The endpoint side (`--sides ... endpoint`, issue 28): the composer-mesh run again with `run.rollout.kind:
harness`, its episodes played by `endpoint_agent`, an agent on the official `openai` client that sleeps the tool
latency and calls the calculator itself, through the harness endpoint; same scripted generator, same turns. The
goal: its steady episodes/s >= 0.8x the built-in driver's at every latency.

    .venv/bin/python benchmarks/bench_agentic.py --quick   # CI-sized: 2 (ours 3) steps x 2 prompts x 2 samples, 1 call
    .venv/bin/python benchmarks/bench_agentic.py           # 5 (ours 12) steps x 4 prompts x 4 samples, 2 calls, 2 TRL modes

Goals (issue 26): composer-mesh >= 10x TRL's episodes/s at 1 s tool latency; ours at 1 s within 2x of ours at
0 s; trainer idle <= 15%; ours no worse than TRL at 0 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import agentic_ablation  # noqa: E402
import hint_probe  # noqa: E402
from machine import (  # noqa: E402
    child_env,
    cli_settings,
    cpu_model,
    package_versions,
    total_memory_gib,
    write_results,
)
from pydantic import BaseModel, Field  # noqa: E402

from composer_mesh.actors.backends.generation.config import HFGeneratorSettings  # noqa: E402
from composer_mesh.actors.backends.generation.hf_generator import HFGenerator  # noqa: E402
from composer_mesh.actors.messages import GenerationRequest, Rollout, RolloutGroup  # noqa: E402
from composer_mesh.envs.calculator import calculator as env_calculator  # noqa: E402

GOAL_SPEEDUP_AT_1S = 10.0  # ours vs TRL, episodes/s, at 1 s tool latency
GOAL_OWN_SLOWDOWN = 2.0  # ours at 1 s vs ours at 0 s
GOAL_IDLE = 0.15  # trainer idle fraction, ours, at every latency
GOAL_ENDPOINT = 0.8  # an openai-client agent through the harness endpoint vs the built-in driver, episodes/s
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SYSTEM = "Use the calculator tool, then answer with the number only."


# ---- the task (TRL's side; composer-mesh's is `run.environment: {kind: calculator}`, the same tool) ---------------


@dataclass(frozen=True)
class CalculatorTask:
    """Products of two 2-digit numbers, answered through a `calculator` tool."""

    low: int = 10
    high: int = 99

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """(user message, answer): e.g. ('47*83', '3901')."""
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return f"{a}*{b}", str(a * b)

    @staticmethod
    def evaluate(expression: str) -> str:
        """What the tool answers: composer_mesh.envs.calculator's answer, or its error as the text the model reads
        (TRL would pass the exception's text on; the scripted expressions never fail)."""
        try:
            return env_calculator(expression)
        except ValueError as e:
            return f"error: calculator: {e}"

    @staticmethod
    def reward(final_text: str, answer: str) -> float:
        """1 when the final assistant text is the answer (surrounding whitespace ignored)."""
        return 1.0 if final_text.strip() == answer else 0.0


TASK = CalculatorTask()


def calculator_tool(latency_s: float, calls: list[float], asynchronous: bool = False) -> Callable[..., Any]:
    """The tool as TRL takes it (name, type hints and docstring become its JSON schema); every call sleeps
    `latency_s` first and appends its duration to `calls`."""

    def calculator(expression: str) -> str:  # the environment's docstring, set below: the same tool schema
        t0 = time.perf_counter()
        time.sleep(latency_s)
        out = TASK.evaluate(expression)
        calls.append(time.perf_counter() - t0)
        return out

    async def calculator_async(expression: str) -> str:  # same docstring, set below
        t0 = time.perf_counter()
        await asyncio.sleep(latency_s)
        out = TASK.evaluate(expression)
        calls.append(time.perf_counter() - t0)
        return out

    calculator.__doc__ = env_calculator.__doc__
    if not asynchronous:
        return calculator
    calculator_async.__name__ = calculator_async.__qualname__ = "calculator"
    calculator_async.__doc__ = env_calculator.__doc__
    return calculator_async


def final_text(completion: Any) -> str:
    """The last assistant message's text of a TRL completion (a list of messages) or a plain string."""
    if isinstance(completion, str):
        return completion
    texts = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return texts[-1] if texts else ""


# ---- the scripted policy ----------------------------------------------------------------------------------------


def tool_call_text(expression: str) -> str:
    """The Qwen/Hermes tool call the qwen2_5 template renders for `calculator(expression)`."""
    args = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call>'


def scripted_turn(conversation: str, tool_calls: int) -> str:
    """The assistant turn the scripted policy plays next in `conversation` (rendered text up to the assistant
    header): a tool call while fewer than `tool_calls` tool results are in it, then the last result."""
    users = re.findall(rf"{re.escape(IM_START)}user\n(.*?){re.escape(IM_END)}", conversation, re.S)
    expressions = [u for u in users if not u.lstrip().startswith("<tool_response>")]
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", conversation, re.S)
    if len(results) < tool_calls:
        return tool_call_text(expressions[0].strip() if expressions else "")
    return (results[-1] if results else "") + IM_END


class ScriptedTurns:
    """A `transformers` LogitsProcessor that forces each row's scripted turn: every logit but the target's is set
    to -inf, so sampling at any temperature picks it; past the script's end it forces `<|im_end|>` (a stop id)."""

    def __init__(self, targets: list[list[int]], prompt_len: int, end_id: int) -> None:
        import torch

        width = max(map(len, targets)) + 1
        self.table = torch.full((len(targets), width), end_id, dtype=torch.long)
        for i, ids in enumerate(targets):
            self.table[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if input_ids.shape[0] != self.table.shape[0]:
            raise RuntimeError(f"scripted policy: batch of {input_ids.shape[0]} rows, script for {self.table.shape[0]}")
        step = min(input_ids.shape[1] - self.prompt_len, self.table.shape[1] - 1)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.table[:, step : step + 1].to(scores.device), 0.0)


def scripted_processor(tokenizer: Any, input_ids: Any, tool_calls: int) -> ScriptedTurns:
    """The scripted policy for one `generate` call on the left-padded batch `input_ids` (each row: the exact
    conversation so far, ending with the assistant header). What a generator hook calls (TRL's side and ours)."""
    pad, end_id = int(tokenizer.pad_token_id), int(tokenizer.convert_tokens_to_ids(IM_END))
    rows = [[t for t in row if t != pad] for row in input_ids.tolist()]  # pad is <|endoftext|>, never in a chat
    targets = [tokenizer.encode(scripted_turn(tokenizer.decode(r), tool_calls), add_special_tokens=False)
               for r in rows]
    return ScriptedTurns(targets, input_ids.shape[1], end_id)


def install_scripted_policy(model: Any, tokenizer: Any, tool_calls: int, generate_s: list[float]) -> None:
    """Wrap `model.generate` so every call plays the script (targets read from each row's prompt ids); the
    seconds of each call go to `generate_s`. TRL calls `unwrapped_model.generate(input_ids=..., ...)`."""
    from transformers import LogitsProcessorList

    original = model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(scripted_processor(tokenizer, input_ids, tool_calls))
        t0 = time.perf_counter()
        try:
            return original(*args, logits_processor=processors, **kwargs)
        finally:
            generate_s.append(time.perf_counter() - t0)

    model.generate = generate


TURN_BUDGET = 96  # max new tokens of one scripted turn (composer-mesh's run.max_new_tokens): a call is ~87


def episode_budget(tool_calls: int) -> int:
    """max_completion_length covering a scripted episode: each call (~90 ids) + its result suffix (~60) + answer."""
    return 160 * tool_calls + 32


# ---- the model ------------------------------------------------------------------------------------------------


def trl_chat_template() -> str:
    """The installed TRL's qwen2_5 tool-calling template, byte for byte (TRL matches it by text)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def build_model_dir(out: Path) -> dict[str, Any]:
    """The tiny Qwen2 with the byte tokenizer under the qwen2_5 template, saved to `out` (both sides load it)."""
    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.tiny import build_tiny

    config = ModelConfig(source="tiny", tokenizer="byte", max_position_embeddings=2048, seed=0)
    model, tokenizer = build_tiny(config)
    tokenizer.chat_template = trl_chat_template()
    tokenizer.eos_token = IM_END  # as Qwen2.5-Instruct: the end of an assistant turn
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "47*83"}],
        tools=[calculator_tool(0.0, [])], add_generation_prompt=True, tokenize=True, return_dict=False)
    return {"dir": str(out), "params": params, "prompt_tokens": len(prompt),
            "description": f"built-in tiny Qwen2 (seed 0, random weights): {params / 1e3:,.0f}K parameters, hidden "
            f"{config.hidden_size}, {config.num_layers} layers, byte tokenizer (vocab {len(tokenizer)}) with TRL's "
            f"qwen2_5.jinja, EOS <|im_end|>, float32; prompt {len(prompt)} tokens (system + tool schema + user); {out}"}


# ---- TRL side (in a child process) ------------------------------------------------------------------------------


class CalculatorEnv:
    """TRL `environment_factory` form of the task: one instance per episode, `reset(**row)` per episode, the tool
    as a method (the episode is scored by the same reward function as the other modes)."""

    latency_s: ClassVar[float] = 0.0  # set per run: TRL builds the instances itself, with no arguments
    calls: ClassVar[list[float]] = []

    def reset(self, **row: Any) -> None:
        self.answer, self.last = str(row.get("answer", "")), ""

    def calculator(self, expression: str) -> str:
        t0 = time.perf_counter()
        time.sleep(self.latency_s)
        self.last = TASK.evaluate(expression)
        type(self).calls.append(time.perf_counter() - t0)
        return self.last

    calculator.__doc__ = env_calculator.__doc__  # the environment's tool schema, as the other modes


def trl_config(spec: dict[str, Any], output_dir: str) -> Any:
    """GRPOConfig: one generation batch of prompts x samples episodes per optimizer step."""
    from trl import GRPOConfig

    n = spec["prompts"] * spec["samples"]
    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=n, num_generations=spec["samples"],
        gradient_accumulation_steps=1, num_iterations=1, max_steps=spec["steps"],
        max_completion_length=episode_budget(spec["tool_calls"]), max_tool_calling_iterations=spec["tool_calls"],
        temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-6, optim="adamw_torch", max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, loss_type="dapo", scale_rewards="group",
        bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False, use_cpu=True, shuffle_dataset=False,
        seed=spec["seed"], report_to="none", save_strategy="no", logging_steps=1, log_completions=False,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    assert config.steps_per_generation == 1 and config.generation_batch_size == n
    return config


def trl_one(spec: dict[str, Any], mode: str, latency_s: float) -> dict[str, Any]:
    """Train `steps` steps of TRL's GRPOTrainer at one tool latency; episodes/s, idle and where the time went."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    rng = random.Random(spec["seed"])
    rows = [TASK.sample(rng) for _ in range(spec["steps"] * spec["prompts"])]
    dataset = Dataset.from_dict({"prompt": [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                                            for q, _ in rows], "answer": [a for _, a in rows]})
    tool_s: list[float] = []
    generate_s: list[float] = []
    score_s: list[float] = []
    rewards: list[float] = []

    def calculator_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        out = [TASK.reward(final_text(c), a) for c, a in zip(completions, answer, strict=True)]
        rewards.extend(out)
        return out

    class Timed(GRPOTrainer):
        """Times generation + tools + scoring: the part of TRL's step in which the optimizer waits."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                score_s.append(time.perf_counter() - t0)

    class Clock(TrainerCallback):
        first: float | None = None
        last: float | None = None
        steps = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.first = self.first or time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.last, self.steps = time.perf_counter(), self.steps + 1

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], local_files_only=True)
    install_scripted_policy(model, tokenizer, spec["tool_calls"], generate_s)
    CalculatorEnv.latency_s, CalculatorEnv.calls = latency_s, tool_s
    tools = {"tools": dict(tools=[calculator_tool(latency_s, tool_s)]),
             "async_tools": dict(tools=[calculator_tool(latency_s, tool_s, asynchronous=True)]),
             "environment": dict(environment_factory=CalculatorEnv)}[mode]
    clock = Clock()
    trainer = Timed(model=model, reward_funcs=calculator_reward,
                    args=trl_config(spec, f"{spec['output_dir']}/{mode}-{latency_s:g}"), train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[clock], **tools)
    trainer.train()
    assert clock.first is not None and clock.last is not None
    episodes = spec["steps"] * spec["prompts"] * spec["samples"]
    wall = clock.last - clock.first
    return {"side": "trl", "mode": mode, "latency_s": latency_s, "status": "ok", "steps": clock.steps,
            "episodes": episodes, "wall_s": wall, "episodes_per_s": episodes / wall,
            "trainer_idle_fraction": sum(score_s) / wall, "generate_and_score_s": sum(score_s),
            "tool_s": sum(tool_s), "generate_s": sum(generate_s), "train_s": wall - sum(score_s),
            "tool_calls": len(tool_s), "tool_calls_per_episode": len(tool_s) / episodes,
            "generate_calls": len(generate_s), "reward_mean": _mean(rewards) if rewards else float("nan")}


def trl_child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Inside the TRL child: every (latency, mode) in order, each with a fresh model and trainer."""
    import torch

    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if spec["warmup"]:  # one untimed step first, so the first measured latency does not pay the process's warm-up
        trl_one({**spec, "steps": 1}, spec["modes"][0], 0.0)
    # interleaved per latency, so load drift on a shared machine hits every mode alike
    return [trl_one(spec, mode, latency) for latency in spec["latencies"] for mode in spec["modes"]]


def run_trl(args: argparse.Namespace, model_dir: str) -> list[dict[str, Any]]:
    """The TRL child; its result is the last stdout line. A failure becomes one failed row per (mode, latency)."""
    spec = dict(model_dir=model_dir, seed=args.seed, steps=args.steps, prompts=args.prompts, samples=args.samples,
                tool_calls=args.tool_calls, threads=args.threads, modes=args.trl_modes, latencies=args.latencies,
                warmup=not args.no_warmup, output_dir=str(args.out / "trl"))
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-child", json.dumps(spec)]
    log = args.out / "trl-log.txt"
    try:
        with log.open("w") as err:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                  env=child_env(ROOT, args.threads), timeout=args.timeout, check=False)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode}): " + (
            log.read_text().strip().splitlines()[-1:] or [""])[0][:200]
    except subprocess.TimeoutExpired:
        status = f"timeout ({args.timeout:.0f} s)"
    if status == "ok":
        return json.loads(proc.stdout.strip().splitlines()[-1])
    return [{"side": "trl", "mode": m, "latency_s": lat, "status": status, "log": str(log)}
            for m in args.trl_modes for lat in args.latencies]


# ---- composer-mesh side -----------------------------------------------------------------------------------------


class ScriptedGeneratorSettings(HFGeneratorSettings):
    """The hf generator's settings plus the script's one knob."""

    tool_calls: int = Field(1, ge=1, description="Calculator calls per episode before the answer (the script).")


def script_ids(tokenizer: Any, conversation: list[int], tool_calls: int, end_id: int) -> list[int]:
    """The token ids of the scripted turn for `conversation` (exact ids up to the assistant header), ending with
    `end_id` (`<|im_end|>`, a stop id): what `ScriptedTurns` forces on TRL's side for the same conversation."""
    ids = tokenizer.encode(scripted_turn(tokenizer.decode(conversation), tool_calls), add_special_tokens=False)
    return ids if ids and ids[-1] == end_id else [*ids, end_id]


def forced_decode(model: Any, prompts: list[list[int]], targets: list[list[int]], temperature: float,
                  pad_id: int, end_id: int, prefix_cache: Any = None,
                  prefix_lengths: list[list[int]] | None = None) -> list[list[float]]:
    """Decode `targets` after `prompts` with the hf generator's own loop (`sampling.decode`: one left-padded
    batch, one forward per token with the KV cache, rows leave the batch at their stop token `end_id`), choosing
    each row's target token instead of a draw. The log-prob of each token is the model's under the distribution
    the hf generator would sample from (`log_softmax(logits / T)`, T 0: untempered): what a sampled token's
    would be, so the trainer sees the usual behaviour log-probs. `prefix_cache`, `prefix_lengths`: the hf
    generator's cache and the prompts' earlier turns' lengths (`Prompt.prefix_lengths`)."""
    import torch

    from composer_mesh.models.sampling import _left_padded, decode

    steps = max(map(len, targets))
    device = next(model.parameters()).device
    table = torch.tensor([t + [t[-1]] * (steps - len(t)) for t in targets], dtype=torch.long, device=device)

    def script(logits: Any, rows: Any, step: int) -> tuple[Any, Any]:
        logits = logits.float()
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        tok = table[rows, step]
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    with torch.inference_mode():
        ids, mask, positions = _left_padded(prompts, pad_id, steps, device)
        _, logps, _, _ = decode(model, ids, mask, positions, max_new_tokens=steps, choose=script,
                                stop=torch.tensor([end_id], device=device), check_every=1, prefix_cache=prefix_cache,
                                prefix_lengths=prefix_lengths)
        rows = logps.tolist()
    return [row[: len(t)] for row, t in zip(rows, targets, strict=True)]


class ScriptedGenerator(HFGenerator):
    """composer-mesh's side of the scripted policy: the hf generator (same model loading, weight loading, batching
    and KV-cache decoding) whose every turn is the script's (`scripted_turn`), as `ScriptedTurns` forces it on
    TRL's `model.generate`. The model runs its forward for every token of every turn on both sides.

    Topology: `generators: {binding: "benchmarks.bench_agentic:ScriptedGenerator", settings: {tool_calls: 2}}`."""

    Settings: ClassVar[type[BaseModel]] = ScriptedGeneratorSettings
    settings: ScriptedGeneratorSettings

    def generate(self, request: GenerationRequest, weight_version: int,
                 refresh: Callable[[], int] | None = None) -> list[RolloutGroup]:
        """The script's turns for `request`'s prompts, stamped with `weight_version` (in-flight updates: no)."""
        from composer_mesh.actors.backends.local_model import check_generation_request, prompt_ids

        model, tokenizer = self._require_started()
        check_generation_request(request)
        ids = [prompt_ids(p, tokenizer, self._vocab, "scripted generator", request.max_new_tokens, self._context)
               for p in request.prompts]
        flat = [(i, ids[i]) for i in range(len(ids)) for _ in range(request.samples_per_prompt)]
        end_id = int(tokenizer.convert_tokens_to_ids(IM_END))
        targets = [script_ids(tokenizer, p, self.settings.tool_calls, end_id)[: request.max_new_tokens]
                   for _, p in flat]
        self._calls += 1
        logprobs: list[list[float]] = []
        with self._lock:
            for start in range(0, len(flat), self.settings.max_batch):
                rows = slice(start, start + self.settings.max_batch)
                logprobs += forced_decode(model, [p for _, p in flat[rows]], targets[rows], request.temperature,
                                          self._pad_id, end_id, self.prefix_cache,
                                          [request.prompts[i].prefix_lengths or [] for i, _ in flat[rows]])
        groups = [RolloutGroup(prompt=p, rollouts=[]) for p in request.prompts]
        for (i, p_ids), tokens, lps in zip(flat, targets, logprobs, strict=True):
            groups[i].rollouts.append(Rollout(
                prompt_id=request.prompts[i].prompt_id, prompt_ids=list(p_ids), completion_ids=tokens, logprobs=lps,
                weight_version=weight_version, text=tokenizer.decode(tokens, skip_special_tokens=True),
                finish_reason="stop" if tokens[-1] in self.stop_ids else "length", generator=self.settings.name))
        return groups


def ours_topology_yaml(latency_s: float, cfg: dict[str, Any], endpoint: bool = False) -> str:
    """composer-mesh's side: one hf trainer, one scripted hf generator, the calculator environment with the tool
    latency, multi-turn episodes, GRPO only (no teachers), `max_policy_lag` from `--lag`. The environment scores
    the episodes: no rewarder role (a multi-turn topology has none). `endpoint`: the same run with the episodes
    played by `endpoint_agent` (an `openai`-client agent) through the harness endpoint (`run.rollout.kind:
    harness`); the calculator environment is then only the prompt stream, the agent sleeps the latency itself."""
    turns = cfg["tool_calls"] + 1
    # every admitted step's episodes at once (lag + 1 steps): every tool wait of a step overlaps
    in_flight = (cfg["lag"] + 1) * cfg["prompts"] * cfg["samples"]
    rollout = f"{{kind: multi_turn, max_turns: {turns}, max_episodes: {in_flight}}}"
    if endpoint:
        rollout = (f"{{kind: harness, max_turns: {turns}, max_episodes: {in_flight}, "
                   f"harness: {{agent: \"benchmarks.bench_agentic:endpoint_agent\"}}}}")
    return f"""\
# Written by benchmarks/bench_agentic.py: composer-mesh's side of the agentic comparison with TRL.
name: bench-agentic-latency{latency_s:g}
python_path: [{json.dumps(ROOT)}]
model: {{source: {json.dumps(cfg["model_dir"])}}}
meshes:
  trainer:    {{backend: local, procs_per_host: 1}}
  generators: {{backend: local, procs_per_host: 1}}
roles:
  trainer:    {{mesh: trainer, binding: hf, settings: {{lr: 1.0e-6, torch_threads: {cfg["threads"]}}}}}
  generators:
    mesh: generators
    binding: "benchmarks.bench_agentic:ScriptedGenerator"
    settings: {{torch_threads: {cfg["threads"]}, tool_calls: {cfg["tool_calls"]}, max_batch: {in_flight}}}
loss: {{alpha_sdpo: 0.0, beta_replay: 0.0}}
run:
  environment: {{kind: calculator, tool_latency_s: {latency_s}, system_prompt: {json.dumps(SYSTEM)}, min_digits: 2,
                max_digits: 2, eval_size: 0}}
  rollout: {rollout}
  max_new_tokens: {TURN_BUDGET}
  steps: {cfg["steps"]}
  prompts_per_step: {cfg["prompts"]}
  samples_per_prompt: {cfg["samples"]}
  temperature: 1.0
  max_policy_lag: {cfg["lag"]}
  eval_prompts: 0
  seed: {cfg["seed"]}
"""


def run_ours(latency_s: float, cfg: dict[str, Any], endpoint: bool = False) -> dict[str, Any]:
    """composer-mesh at one tool latency: {episodes_per_s, trainer_idle_fraction, episodes, wall_s, ...}.

    Writes `ours_topology_yaml(latency_s, cfg)` to a run dir, runs `python -m composer_mesh.cli run FILE
    --run-dir DIR` and reads DIR/metrics.jsonl (`summarise_ours`). RuntimeError when the run fails (the log's
    last line)."""
    run_dir = Path(cfg["out"]) / f"{'endpoint-' if endpoint else ''}latency{latency_s:g}"
    run_dir.mkdir(parents=True, exist_ok=True)
    topo = run_dir / "topology.yaml"
    topo.write_text(ours_topology_yaml(latency_s, cfg, endpoint))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "composer_mesh.cli", "run", str(topo), "--run-dir", str(run_dir)]
    with (run_dir / "log.txt").open("w") as log:
        try:
            env = {**child_env(ROOT, cfg["threads"]), ENDPOINT_LATENCY_ENV: str(latency_s),
                   ENDPOINT_CALLS_ENV: str(cfg["tool_calls"]), ENDPOINT_HTTP_ENV: cfg["agent_http"]}
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=cfg["timeout"],
                                  env=env, check=False)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"timeout ({cfg['timeout']:.0f} s); log {run_dir / 'log.txt'}") from e
    if proc.returncode != 0:
        tail = (run_dir / "log.txt").read_text().strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"exit {proc.returncode}: {tail[0][:200]}; log {run_dir / 'log.txt'}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {**summarise_ours(lines), "run_dir": str(run_dir)}


def summarise_ours(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """episodes/s over the training window (`train_start` event -> the last step line's `elapsed_s`; the generators
    start after `train_start`), trainer idle = the steps' `timing.trainer_idle_s` / that window (TRL: generation
    and scoring seconds / its window), where the time went, and the checks on the scripted episodes (tool calls
    and policy turns per episode, from the step's `episode/*` means)."""
    steps = [o for o in lines if "step" in o and "event" not in o]
    start = next((o for o in lines if o.get("event") == "train_start"), None)
    if not steps or start is None:
        raise RuntimeError("metrics.jsonl has no step lines or no train_start event")
    episodes = sum(int(o["rollouts"]) for o in steps)
    wall = float(steps[-1]["elapsed_s"]) - float(start["elapsed_s"])

    def timing(key: str) -> float:
        return sum(float((o.get("timing") or {}).get(key, 0.0)) for o in steps)

    def per_episode(key: str) -> float:  # the steps' per-episode means, weighted by their episodes
        return sum(float(o.get("metrics", {}).get(key, float("nan"))) * int(o["rollouts"]) for o in steps) / episodes

    # after the pipeline fill (step 1's idle is the wait for the first episodes): the steps' `step_s` tile the
    # window from train_start (a step line is written a little after its step, so its elapsed_s is no boundary)
    later = steps[1:]
    later_wall = sum(float(o["step_s"]) for o in later)
    later_idle = sum(float((o.get("timing") or {}).get("trainer_idle_s", 0.0)) for o in later)
    steady = {"steady_episodes_per_s": sum(int(o["rollouts"]) for o in later) / later_wall,
              "steady_trainer_idle_fraction": later_idle / later_wall} if later and later_wall > 0 else {}
    return {"steps": len(steps), "episodes": episodes, "wall_s": wall, "episodes_per_s": episodes / wall, **steady,
            "trainer_idle_fraction": timing("trainer_idle_s") / wall, "trainer_idle_s": timing("trainer_idle_s"),
            "generate_s": timing("generate_s"), "train_s": timing("train_s"), "sync_s": timing("sync_s"),
            "policy_lag_max": max(int(o.get("policy_lag", 0)) for o in steps),
            "tool_calls_per_episode": per_episode("episode/tool_calls"),
            "turns_per_episode": per_episode("episode/turns"),
            "done_fraction": per_episode("episode/status_done"),
            "reward_mean": _mean([float(o["reward"]) for o in steps if "reward" in o])}


def run_ours_all(args: argparse.Namespace, model_dir: str) -> list[dict[str, Any]]:
    cfg = dict(model_dir=model_dir, seed=args.seed, steps=args.ours_steps, prompts=args.prompts, samples=args.samples,
               tool_calls=args.tool_calls, threads=args.threads, out=str(args.out / "ours"), timeout=args.timeout,
               lag=args.lag, agent_http=args.agent_http)
    rows = []
    sides = [(side, side == "endpoint") for side in ("ours", "endpoint") if side in args.sides]
    for latency in args.latencies:
        for side, endpoint in sides:
            try:
                rows.append({"side": side, "latency_s": latency, "status": "ok", **run_ours(latency, cfg, endpoint)})
            except RuntimeError as e:
                rows.append({"side": side, "latency_s": latency, "status": f"failed: {e}"})
    return rows


ENDPOINT_LATENCY_ENV = "BENCH_AGENTIC_TOOL_LATENCY_S"  # what `endpoint_agent` sleeps per tool call
ENDPOINT_CALLS_ENV = "BENCH_AGENTIC_TOOL_CALLS"
ENDPOINT_HTTP_ENV = "BENCH_AGENTIC_AGENT_HTTP"  # the agent's openai HTTP backend: aiohttp | httpx


async def endpoint_agent(task: Any) -> float:
    """The endpoint side's agent, written as anyone would against the official `openai` client: ask with the
    task's tools, run each tool call (the calculator after the benchmark's latency, an asyncio sleep as the
    built-in environment's), send the results back, and reward the final answer 1 when it is the product. The
    scripted generator makes the same calls as on the built-in side, so both sides play the same episodes."""
    import openai

    latency, calls = float(os.environ.get(ENDPOINT_LATENCY_ENV, "0")), int(os.environ.get(ENDPOINT_CALLS_ENV, "1"))
    client = _openai_client(openai, task)
    messages: list[Any] = list(task.messages)
    for _ in range(calls + 1):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=task.tools,
                                                 extra_headers=task.headers)
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == task.answer)
        for call in message.tool_calls:
            await asyncio.sleep(latency)
            result = env_calculator(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


_CLIENTS: dict[str, Any] = {}
_CLOSERS: list[asyncio.Future[None]] = []  # the tasks that close each client at exit (kept: a task needs a reference)


def _openai_client(openai: Any, task: Any) -> Any:
    """One client (one connection pool) per endpoint, as an agent process would keep, on the HTTP backend
    `--agent-http` names: `aiohttp` (`openai.DefaultAioHttpClient()`, what openai's README advises for many
    concurrent requests) or `httpx` (the client's default; its pool scans every open connection for each request,
    so with a step's episodes all in flight the agent's own client costs more than the endpoint: docs/benchmarks.md).
    The client is closed when the run's event loop cancels its tasks at exit."""
    if task.base_url not in _CLIENTS:
        http = openai.DefaultAioHttpClient() if os.environ.get(ENDPOINT_HTTP_ENV, "aiohttp") == "aiohttp" else None
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0, http_client=http)
        _CLIENTS[task.base_url] = client
        _CLOSERS.append(asyncio.ensure_future(_close_at_exit(client)))
    return _CLIENTS[task.base_url]


async def _close_at_exit(client: Any) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await client.close()


# ---- summary, goals, printing -----------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _ok(rows: list[dict[str, Any]], side: str, latency: float, mode: str | None = None) -> dict[str, Any] | None:
    return next((r for r in rows if r["side"] == side and r["latency_s"] == latency and r["status"] == "ok"
                 and (mode is None or r.get("mode") == mode)), None)


def trl_reference(rows: list[dict[str, Any]], latency: float) -> dict[str, Any] | None:
    """TRL's best mode at this latency (the ratio is against the fastest TRL setting)."""
    ok = [r for r in rows if r["side"] == "trl" and r["latency_s"] == latency and r["status"] == "ok"]
    return max(ok, key=lambda r: r["episodes_per_s"]) if ok else None


def steady(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """composer-mesh's row at its steady state, what the goals judge: episodes/s and trainer idle over the steps
    after the first (the pipeline's fill, which a run of hundreds of steps pays once; TRL's first-call costs are
    outside its window too, in the untimed warm-up step)."""
    if row is None or "steady_episodes_per_s" not in row:
        return None
    return {**row, "episodes_per_s": row["steady_episodes_per_s"],
            "trainer_idle_fraction": row["steady_trainer_idle_fraction"]}


def goals(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's four goals, PASS/MISS (MISS with 'not measured' when a side or latency did not run), ours at its
    steady state (`steady`)."""
    lo, hi = min(args.latencies), max(args.latencies)
    ours_lo, ours_hi = steady(_ok(rows, "ours", lo)), steady(_ok(rows, "ours", hi))
    trl_lo, trl_hi = trl_reference(rows, lo), trl_reference(rows, hi)
    ours_all = [s for r in rows if r["side"] == "ours" and r["status"] == "ok" and (s := steady(r)) is not None]
    out = []

    def add(goal: str, ready: bool, got: Callable[[], tuple[str, bool]], need: str = "") -> None:
        text, ok = got() if ready else ("not measured" + need, False)
        out.append({"goal": goal, "got": text, "pass": ok})

    add(f">= {GOAL_SPEEDUP_AT_1S:g}x TRL's episodes/s at {hi:g} s tool latency", bool(ours_hi and trl_hi),
        lambda: (f"{ours_hi['episodes_per_s'] / trl_hi['episodes_per_s']:.2f}x",
                 ours_hi["episodes_per_s"] >= GOAL_SPEEDUP_AT_1S * trl_hi["episodes_per_s"]),
        f" (needs >= {GOAL_SPEEDUP_AT_1S * trl_hi['episodes_per_s']:.2f} episodes/s)" if trl_hi else "")
    add(f"ours at {hi:g} s within {GOAL_OWN_SLOWDOWN:g}x of ours at {lo:g} s", bool(ours_lo and ours_hi),
        lambda: (f"{ours_lo['episodes_per_s'] / ours_hi['episodes_per_s']:.2f}x slower",
                 ours_hi["episodes_per_s"] * GOAL_OWN_SLOWDOWN >= ours_lo["episodes_per_s"]))
    add(f"trainer idle <= {GOAL_IDLE:.0%} (ours, every latency)", len(ours_all) == len(args.latencies),
        lambda: (f"max {max(r['trainer_idle_fraction'] for r in ours_all):.0%}",
                 max(r["trainer_idle_fraction"] for r in ours_all) <= GOAL_IDLE))
    add(f"ours no worse than TRL at {lo:g} s", bool(ours_lo and trl_lo),
        lambda: (f"{ours_lo['episodes_per_s'] / trl_lo['episodes_per_s']:.2f}x",
                 ours_lo["episodes_per_s"] >= trl_lo["episodes_per_s"]),
        f" (needs >= {trl_lo['episodes_per_s']:.2f} episodes/s)" if trl_lo else "")
    if "endpoint" in args.sides:
        pairs = [(steady(_ok(rows, "endpoint", lat)), steady(_ok(rows, "ours", lat))) for lat in args.latencies]
        ratios = [e["episodes_per_s"] / o["episodes_per_s"] for e, o in pairs if e and o]
        add(f"endpoint (openai-client agent) >= {GOAL_ENDPOINT:g}x the built-in driver's episodes/s, every latency",
            len(ratios) == len(args.latencies),
            lambda: (f"min {min(ratios):.2f}x", min(ratios) >= GOAL_ENDPOINT))
    return out


def _markdown(head: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


def _cell(row: dict[str, Any] | None, key: str, fmt: str) -> str:
    return format(row[key], fmt) if row else "-"


def _ratio(ours: dict[str, Any] | None, trl: dict[str, Any] | None) -> str:
    return f"{ours['episodes_per_s'] / trl['episodes_per_s']:.2f}x" if ours and trl else "-"


def main_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """Rows: latency; TRL (fastest mode) vs ours episodes/s and their ratio, ours at its steady state (`steady`)
    and over all its steps (the pipeline's fill included), and each side's trainer idle."""
    head = ["tool latency", "TRL episodes/s", "ours episodes/s", "ours / TRL", "ours, all steps",
            "ours / TRL, all steps", "TRL trainer idle", "ours trainer idle"]
    lines = []
    for lat in args.latencies:
        trl, every = trl_reference(rows, lat), _ok(rows, "ours", lat)
        ours = steady(every)
        trl_label = f"{_cell(trl, 'episodes_per_s', '.2f')} ({trl['mode']})" if trl else "failed"
        lines.append([f"{lat * 1000:g} ms", trl_label, _cell(ours, "episodes_per_s", ".2f") if ours else "n/a",
                      _ratio(ours, trl), _cell(every, "episodes_per_s", ".2f") if every else "n/a",
                      _ratio(every, trl),
                      _cell(trl, "trainer_idle_fraction", ".0%"), _cell(ours, "trainer_idle_fraction", ".0%")])
    return _markdown(head, lines)


def trl_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """Every TRL row: where a step's time went (seconds per step) and the checks on the scripted episodes."""
    head = ["TRL mode", "tool latency", "episodes/s", "trainer idle", "tools s/step", "generate s/step",
            "train s/step", "tool calls / episode", "reward mean"]
    lines = []
    for r in (r for r in rows if r["side"] == "trl"):
        if r["status"] != "ok":
            lines.append([r["mode"], f"{r['latency_s'] * 1000:g} ms", r["status"], *["-"] * 6])
            continue
        s = max(1, r["steps"])
        lines.append([r["mode"], f"{r['latency_s'] * 1000:g} ms", f"{r['episodes_per_s']:.2f}",
                      f"{r['trainer_idle_fraction']:.0%}", f"{r['tool_s'] / s:.2f}", f"{r['generate_s'] / s:.2f}",
                      f"{r['train_s'] / s:.2f}", f"{r['tool_calls_per_episode']:.2f}", f"{r['reward_mean']:.2f}"])
    return _markdown(head, lines)


def ours_table(rows: list[dict[str, Any]], side: str = "ours") -> list[str]:
    """Every composer-mesh row of `side` (ours: the built-in driver; endpoint: the openai-client agent through the
    harness endpoint): where a step's time went (seconds per step; generate and train overlap) and the checks on
    the scripted episodes (the endpoint's tool calls are the agent's, not counted by an environment: nan)."""
    head = ["tool latency", "episodes/s", "trainer idle", "after step 1: episodes/s", "after step 1: idle",
            "generate s/step", "train s/step", "tool calls / episode", "turns / episode", "reward mean"]
    lines = []
    for r in (r for r in rows if r["side"] == side):
        if r["status"] != "ok":
            lines.append([f"{r['latency_s'] * 1000:g} ms", r["status"][:120], *["-"] * 8])
            continue
        s = max(1, r["steps"])
        lines.append([f"{r['latency_s'] * 1000:g} ms", f"{r['episodes_per_s']:.2f}", f"{r['trainer_idle_fraction']:.0%}",
                      _cell(r if "steady_episodes_per_s" in r else None, "steady_episodes_per_s", ".2f"),
                      _cell(r if "steady_trainer_idle_fraction" in r else None, "steady_trainer_idle_fraction", ".0%"),
                      f"{r['generate_s'] / s:.2f}", f"{r['train_s'] / s:.2f}", f"{r['tool_calls_per_episode']:.2f}",
                      f"{r['turns_per_episode']:.2f}", f"{r['reward_mean']:.2f}"])
    return _markdown(head, lines)


def describe(args: argparse.Namespace, model: dict[str, Any]) -> dict[str, str]:
    versions = package_versions("torch", "transformers", "trl", "datasets", "accelerate", "torchmonarch",
                                "composer-mesh")
    n = args.prompts * args.samples
    return {
        "hardware": f"{cpu_model()}, {os.cpu_count()} logical CPUs, {total_memory_gib():.1f} GiB RAM; load average "
        f"{args.load_at_start:.1f} at start (other work on the machine makes the seconds noisy)",
        "versions": f"python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v != "?"),
        "model": model["description"],
        "run": f"TRL {args.steps} steps, composer-mesh {args.ours_steps} steps; {args.prompts} prompts x "
        f"{args.samples} samples = {n} episodes per step; "
        f"scripted policy: {args.tool_calls} calculator call(s) then the answer ({args.tool_calls + 1} assistant "
        f"turns) per episode; tool latencies {', '.join(f'{x:g} s' for x in args.latencies)}; seed {args.seed}; "
        f"{args.threads} torch/OMP thread(s); TRL modes {', '.join(args.trl_modes)} (one child, interleaved per latency, "
        f"{'no warm-up' if args.no_warmup else 'after one untimed warm-up step'}); composer-mesh max_policy_lag "
        f"{args.lag} (TRL is synchronous)",
        "timing": "episodes/s = episodes / seconds from the first step's begin to the last step's end (startup "
        "excluded); trainer idle = share of that window spent outside the optimizer's work (TRL: generation, "
        "tools and scoring inside its step)",
    }


def report(args: argparse.Namespace, model: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    info = describe(args, model)
    print()
    for key, text in info.items():
        print(f"{key}: {text}")
    print("\nepisodes/s side by side (TRL: its fastest mode at each latency; ours: after its first step, the "
          "pipeline's fill, unless 'all steps')")
    print("\n".join(main_table(args, rows)))
    print("\nTRL, where the time went")
    print("\n".join(trl_table(args, rows)))
    print("\ncomposer-mesh, where the time went (its generator and trainer run at once)")
    print("\n".join(ours_table(rows)))
    if "endpoint" in args.sides:
        print(f"\ncomposer-mesh through the harness endpoint (an openai-client agent plays the episodes, HTTP: "
              f"{args.agent_http})")
        print("\n".join(ours_table(rows, "endpoint")))
    result_goals = goals(args, rows)
    print("\ngoals")
    for g in result_goals:
        print(f"  {'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['got']}")
    settings = cli_settings(args, "trl_child")
    payload = {**info, "settings": settings, "model_dir": model["dir"], "params": model["params"],
               "prompt_tokens": model["prompt_tokens"], "rows": rows, "goals": result_goals}
    write_results(args.out, payload, args.json)
    return payload


def report_ablation(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ablation's table (held-out success with and without targeted feedback, same seeds) and results.json."""
    versions = package_versions("torch", "transformers", "torchmonarch", "composer-mesh")
    info = {"hardware": f"{cpu_model()}, {os.cpu_count()} logical CPUs, {total_memory_gib():.1f} GiB RAM",
            "versions": f"python {platform.python_version()}, " + ", ".join(f"{k} {v}" for k, v in versions.items()),
            "run": f"topologies/agentic.yaml without its teacher, {args.ablation_steps} steps x {args.prompts_per_step} "
            f"prompts x 4 episodes, max_policy_lag 0, warm start {args.warmstart_steps} SFT steps of "
            f"{args.warmstart_task}; held-out greedy "
            f"success on {args.eval_size} problems before and after; hints arm loss.alpha_sdpo {args.alpha:g}, "
            f"sdpo_jsd_beta {args.jsd_beta:g}, "
            f"hints.source environment; seeds {', '.join(map(str, args.seeds))}"}
    print()
    for key, text in info.items():
        print(f"{key}: {text}")
    print("\nheld-out success with and without targeted feedback")
    print("\n".join(agentic_ablation.table(rows)))
    means = {arm: agentic_ablation.mean_change(rows, arm) for arm in agentic_ablation.ARMS}
    print("\nmean change: " + ", ".join(f"{arm} {m:+.3f}" if m is not None else f"{arm} -" for arm, m in means.items()))
    probe = agentic_ablation.warm_start_probe(agentic_ablation.cfg_of(args), args.seeds[0])
    print("\nis the hinted warm start a better teacher than itself? (benchmarks/hint_probe.py)")
    print("\n".join(hint_probe.table(probe)))
    payload = {**info, "settings": cli_settings(args, "trl_child"), "ablation": rows, "mean_change": means,
               "probe": probe}
    write_results(args.out, payload, args.json)
    return payload


# ---- command line ---------------------------------------------------------------------------------------------

DEFAULTS: dict[str, dict[str, Any]] = {
    "quick": dict(steps=2, ours_steps=3, prompts=2, samples=2, tool_calls=1, trl_modes=["tools"], timeout=600.0),
    "full": dict(steps=5, ours_steps=12, prompts=4, samples=4, tool_calls=2, trl_modes=["tools", "environment"],
                 timeout=3600.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", "--ci", dest="quick", action="store_true",
                   help="CI-sized: 2 steps x 2 prompts x 2 samples, 1 tool call, TRL mode tools")
    p.add_argument("--steps", type=int, help="optimizer steps per (side, latency) (default 5; quick 2)")
    p.add_argument("--prompts", type=int, help="prompts per step (default 4; quick 2)")
    p.add_argument("--samples", type=int, help="episodes per prompt, the GRPO group (default 4; quick 2)")
    p.add_argument("--tool-calls", type=int, help="calculator calls per episode (default 2; quick 1)")
    p.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.1, 1.0], help="seconds per tool call")
    p.add_argument("--trl-modes", nargs="+", choices=["tools", "async_tools", "environment"],
                   help="how TRL gets the tool (default tools environment; quick tools)")
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads of each side's processes")
    p.add_argument("--lag", type=int, default=3,
                   help="composer-mesh's run.max_policy_lag (TRL is synchronous). 3: an episode's two 1 s tool calls "
                        "outlast two training steps, so the episodes of three steps ahead keep the trainer fed")
    p.add_argument("--ours-steps", type=int, help="composer-mesh's steps per latency (default 12; quick 3): its "
                   "first step is the pipeline's fill, the goals use the steps after it")
    p.add_argument("--no-warmup", action="store_true", help="TRL: skip the untimed 1-step run before the sweep")
    p.add_argument("--seed", type=int, default=0, help="prompt stream and sampling seed")
    p.add_argument("--timeout", type=float, help="seconds for each side's whole sweep (default 3600; quick 600)")
    p.add_argument("--out", type=Path, help="model, logs and results.json (default runs/bench_agentic)")
    p.add_argument("--json", type=Path, help="also write the results JSON here")
    p.add_argument("--sides", nargs="+", choices=["trl", "ours", "endpoint"], default=["trl", "ours", "endpoint"],
                   help="what runs: TRL, composer-mesh's built-in episode driver, and the same run with an "
                        "openai-client agent playing through the harness endpoint (run.rollout.kind: harness)")
    p.add_argument("--agent-http", choices=["aiohttp", "httpx"], default="aiohttp",
                   help="the endpoint side's agent: the openai client's HTTP backend (aiohttp: "
                        "openai.DefaultAioHttpClient(), openai's advice for many concurrent requests; httpx: its default)")
    p.add_argument("--trl-child", help=argparse.SUPPRESS)
    agentic_ablation.add_arguments(p)
    args = p.parse_args(argv)
    size = "quick" if args.quick else "full"
    for key, value in {**DEFAULTS[size], **agentic_ablation.ABLATION_DEFAULTS[size]}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if min(args.steps, args.prompts, args.samples, args.tool_calls) < 1 or args.ours_steps < 2:
        p.error("--steps, --prompts, --samples and --tool-calls must be >= 1, --ours-steps >= 2")
    args.latencies = sorted(set(args.latencies))
    args.out = (args.out or Path(ROOT) / "runs" / "bench_agentic").resolve()
    args.load_at_start = os.getloadavg()[0]
    return args


def main() -> None:
    args = parse_args()
    if args.trl_child:
        print(json.dumps(trl_child(json.loads(args.trl_child))))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ablation:
        report_ablation(args, agentic_ablation.run(args, child_env(ROOT, args.threads)))
        return
    model = build_model_dir(args.out / "model")
    rows = []
    if "trl" in args.sides:
        print("  TRL: running ...", file=sys.stderr, flush=True)
        rows += run_trl(args, model["dir"])
    rows += run_ours_all(args, model["dir"])
    report(args, model, rows)


if __name__ == "__main__":
    main()
