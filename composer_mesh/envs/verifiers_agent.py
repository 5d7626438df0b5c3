"""A verifiers 0.4 task with tools and turns, played as a harness agent (`run.rollout.harness.agent:
composer_mesh.envs.verifiers_agent:play`, docs/verifiers.md "Tasks with tools and turns"), or as the episode
driver's session (`VerifiersSession`, `run.rollout.kind: multi_turn`): the same loop either way.

What verifiers' own loop does, and what this keeps. A verifiers rollout (`vf.Env`, `verifiers.v1.rollout`) starts a
runtime, serves each `vf.Toolset` as an MCP server in a process of its own, puts an interception server between
the harness program and the model, and launches the harness program (its chat loop, a PEP 723 script run with
`uv`). The chat loop is: send the conversation and the tools; an answer with tool calls gets each call's result
as a tool message and the loop goes on; an answer without calls ends the episode; then `Task.score(trace)`.
`play` is that loop in the controller's event loop, talking to the run's OpenAI-compatible endpoint (the
episode's id in a header, so every served token is the episode's policy turn) and calling the toolsets' `@vf.tool`
methods in this process, named as verifiers' chat program names them (`<server>_<tool>`, or bare for a toolset
whose `TOOL_PREFIX` is None). Its reward is the task's own rubric on the verifiers trace of the whole
conversation, tool calls and results included.

Why not verifiers' own harness programs: they need `uv` and the network to install their script's dependencies
in each runtime, and each rollout would start a process per toolset and an interception server that re-encodes
every request, where the endpoint takes only the exact conversation it served (a prefix). In-process tools are
what verifiers' default (`SubprocessConfig`) runs anyway, a process on the same host without isolation; a toolset
that asks for anything else (a container runtime, a remote `url`) or keeps a `State` (synced through verifiers'
interception) is refused, naming the task and the toolset, as are tasks whose rewards all need a runtime.

What the policy does wrong is data, never a crash: a malformed call (the endpoint serves it as text) is answered
with a user message naming the error and the episode goes on; an unknown tool, bad arguments, a tool that raises
or times out is a tool message `error: <tool>: ...` (`envs.tools.Toolbox`). The run's limits
(`run.rollout.max_turns`, `max_context`) end an episode: the endpoint refuses the next request, and the
conversation so far is scored.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from composer_mesh.envs.session import EpisodePrompt, Observation, StepResult
from composer_mesh.envs.tool_session import format_error_message, mistakes
from composer_mesh.envs.tools import (
    ParsedTurn,
    Tool,
    Toolbox,
    ToolCall,
    ToolDefinitionError,
    parse_tool_calls,
)
from composer_mesh.envs.verifiers import (
    EXTRA_KEY,
    VerifiersEnvironment,
    load,
    opening_messages,
    prompt_messages,
    rebuild_task,
    task_trace,
)
from composer_mesh.errors import UserInputError

if TYPE_CHECKING:
    import openai
    import verifiers.v1 as vf

log = logging.getLogger("composer_mesh.envs.verifiers")
LIMIT_REACHED = "report its end"  # what the endpoint's refusal says once run.rollout.max_turns or max_context is hit
TOOL_TIMEOUT_S = 30.0  # per call, for tools without their own


class EpisodeTask(Protocol):
    """What `play` reads of its task (`orchestration.rollout.harness_episodes.HarnessTask` has it)."""

    episode_id: str
    base_url: str
    api_key: str
    extra: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]: ...


class UnplayableToolset(UserInputError, ValueError):
    """A toolset `play` cannot run in this process (a container runtime, a remote url, a synced `State`)."""


async def play(task: EpisodeTask) -> float:
    """Play one episode of the verifiers task the prompt was made from (`task.extra["verifiers"]`) against the
    run's endpoint, with its toolsets' tools; the reward is the task's rubric on the whole conversation."""
    import openai

    where = task.extra.get(EXTRA_KEY)
    if not isinstance(where, dict):
        raise ValueError(f"episode {task.episode_id}: the prompt has no extra['verifiers'] (only prompts of a "
                         "verifiers run.environment can be played by composer_mesh.envs.verifiers_agent:play)")
    vtask = rebuild_task(where["env"], where["task"])
    own, shared = task_toolsets(vtask, where["env"])
    conversation = Conversation(vtask.data)
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    try:
        toolbox = await open_toolbox(own, shared, vtask)
        await converse(client, task.headers, conversation, toolbox)
    finally:
        await client.close()
        await close_toolsets([*own, *shared])
    return await score(vtask, conversation.messages)


def task_toolsets(vtask: vf.Task, env_config: dict[str, Any]) -> tuple[list[vf.Toolset], list[vf.Toolset]]:
    """The toolsets an episode of `vtask` calls: the task's own (verifiers starts them per rollout) and its
    taskset's (shared by every rollout there; here made per episode too), each checked to run in this process."""
    taskset = load(env_config).taskset
    own, shared = type(vtask).toolsets(vtask.config), type(taskset).toolsets(taskset.config)
    for toolset in [*own, *shared]:
        check_toolset(toolset, vtask.data.idx)
    return own, shared


def check_toolset(toolset: vf.Toolset, idx: int | None) -> None:
    """Refuse, in one line naming the task and the toolset, what cannot run in this process."""
    from verifiers.v1.state import State, state_cls

    name = type(toolset).__name__
    runtime = getattr(getattr(toolset.config, "runtime", None), "type", "subprocess")
    if getattr(toolset.config, "url", None):
        problem = f"is served at a url ({toolset.config.url})"
    elif runtime != "subprocess":
        problem = f"runs in a {runtime} runtime"
    elif state_cls(type(toolset)) is not State:
        problem = f"keeps a State ({state_cls(type(toolset)).__name__}) synced through verifiers' interception"
    else:
        return
    raise UnplayableToolset(f"verifiers task {idx}: toolset {name} {problem}; composer_mesh plays toolsets in "
                            "its own process only (verifiers' default subprocess runtime, no State)")


async def open_toolbox(own: list[vf.Toolset], shared: list[vf.Toolset], vtask: vf.Task) -> Toolbox:
    """Set the toolsets up as verifiers does (`setup`; then `setup_task` for the task's own: a shared server is
    task-agnostic) and gather their `@vf.tool` methods into one toolbox."""
    from verifiers.v1.utils.decorators import discover_decorated

    tools: list[Tool] = []
    for toolset in [*own, *shared]:
        await toolset.setup()
        if any(toolset is t for t in own):
            await toolset.setup_task(vtask)
        prefix = toolset.server_name
        for fn in discover_decorated(toolset, "tool"):
            name = getattr(fn, "tool_name", None) or fn.__name__
            tools.append(toolset_tool(fn, f"{prefix}_{name}" if prefix else name))
    return Toolbox(tools, timeout_s=TOOL_TIMEOUT_S)


def toolset_tool(fn: Callable[..., Any], name: str) -> Tool:
    """A `@vf.tool` method as a tool: its schema from its type hints and docstring, as every composer tool's
    (what chat templates render), or, when the docstring does not document the arguments, as verifiers' MCP
    server advertises it."""
    try:
        return Tool(fn, name=name)
    except ToolDefinitionError:
        return McpSchemaTool(fn, name)


class McpSchemaTool(Tool):
    """A tool whose schema is the MCP server's (pydantic's of the signature; the docstring as description)."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        from mcp.server.mcpserver.utilities.func_metadata import func_metadata

        parameters = func_metadata(fn).arg_model.model_json_schema()
        self.fn, self.timeout_s, self.name = fn, None, name
        self.schema = {"type": "function", "function": {"name": name, "description": (fn.__doc__ or "").strip(),
                                                        "parameters": parameters}}
        self.signature = inspect.signature(fn)
        self.is_async = inspect.iscoroutinefunction(fn)


async def close_toolsets(toolsets: list[vf.Toolset]) -> None:
    """Release what the toolsets' setup entered (`ServerBase._exit_stack`, what their server closes on exit)."""
    for toolset in toolsets:
        try:
            await toolset._exit_stack.aclose()
        except Exception as e:  # a toolset's teardown must not lose the episode
            log.warning("verifiers toolset %s: teardown failed: %s: %s", type(toolset).__name__, type(e).__name__, e)


class Conversation:
    """The episode's conversation twice over: as sent to the endpoint (OpenAI messages, served answers exactly
    as served) and as verifiers messages with whether the policy sampled each (the trace to score)."""

    def __init__(self, data: Any) -> None:
        self.wire: list[dict[str, Any]] = [wire_message(m) for m in prompt_messages(data)]
        self.messages: list[tuple[Any, bool]] = opening_messages(data)

    def served(self, message: openai.types.chat.ChatCompletionMessage) -> None:
        import verifiers.v1 as vf

        self.wire.append(message.model_dump(exclude_none=True))
        calls = [vf.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                 for c in message.tool_calls or [] if c.type == "function"]
        self.messages.append((vf.AssistantMessage(content=message.content, tool_calls=calls or None), True))

    def tool_result(self, call_id: str, result: dict[str, Any]) -> None:
        import verifiers.v1 as vf

        self.wire.append({"role": "tool", "tool_call_id": call_id, "content": result["content"]})
        self.messages.append((vf.ToolMessage(tool_call_id=call_id, name=result["name"], content=result["content"]),
                              False))

    def user(self, text: str) -> None:
        import verifiers.v1 as vf

        self.wire.append({"role": "user", "content": text})
        self.messages.append((vf.UserMessage(content=text), False))


def wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat-template message (`prompt_messages`) as the Chat Completions API takes it (arguments as JSON text)."""
    if message["role"] == "tool":
        return {"role": "tool", "tool_call_id": message["tool_call_id"], "content": message["content"]}
    if message.get("tool_calls"):
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                  "arguments": json.dumps(c["function"]["arguments"])}}
                 for c in message["tool_calls"]]
        return {"role": "assistant", "content": message["content"], "tool_calls": calls}
    return dict(message)


async def converse(client: openai.AsyncOpenAI, headers: dict[str, str], conversation: Conversation,
                   toolbox: Toolbox) -> None:
    """verifiers' chat loop: ask; run the answer's tool calls and ask again; stop at an answer without calls, or
    when the endpoint's limits refuse the next turn. A malformed call is told to the policy, which plays on."""
    import openai

    while True:
        try:
            response = await client.chat.completions.create(model="policy", messages=conversation.wire,
                                                            tools=toolbox.schemas or openai.NOT_GIVEN,
                                                            extra_headers=headers)
        except openai.BadRequestError as e:
            if LIMIT_REACHED not in str(e):
                raise
            return  # the endpoint set the episode's status (truncated_turns or truncated_context)
        message = response.choices[0].message
        conversation.served(message)
        if message.tool_calls:
            await answer_calls(message, conversation, toolbox)
            continue
        errors = parse_tool_calls(message.content or "").errors  # a call the endpoint could not read
        if not errors:
            return
        conversation.user(format_error_message(errors)["content"])


async def answer_calls(message: openai.types.chat.ChatCompletionMessage, conversation: Conversation,
                       toolbox: Toolbox) -> None:
    """Run the answer's tool calls concurrently; a tool message per call, in order."""
    calls = [c for c in message.tool_calls or [] if c.type == "function"]
    parsed = [ToolCall(c.function.name, _arguments(c.function.arguments)) for c in calls]
    results = await toolbox.call_all(parsed)
    for call, result in zip(calls, results, strict=True):
        conversation.tool_result(call.id, result)


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments (JSON text; the endpoint serves only objects): anything else is no arguments, which
    the toolbox answers with the missing ones."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


async def score(vtask: vf.Task, messages: list[tuple[Any, bool]]) -> float:
    """The task's rubric (`Task.score`) on the trace of `messages` (each with whether the policy sampled it), in
    a worker thread: a reward is the taskset author's code and may block."""
    trace = task_trace(vtask, messages)
    await asyncio.to_thread(asyncio.run, vtask.score(trace))
    if not trace.rewards:
        raise ValueError(f"verifiers task {vtask.data.idx} ({type(vtask).__name__}) recorded no reward: its "
                         "rewards need a runtime (the sandbox an agent ran in)")
    return float(trace.reward)


# ------------------------------------------------------------------------------------ multi_turn episodes
class VerifiersSession:
    """One episode of a verifiers task as an `EnvSession` (`run.rollout.kind: multi_turn`): the episode driver
    plays it token in, token out and hands each policy turn's text here. The same loop as `play`: a turn's
    Hermes tool calls run against the task's toolsets and their results are the observation, a malformed call is
    told in a user message, a turn without calls ends the episode and the task's rubric scores the whole
    conversation. An episode the driver cuts (`max_turns`, `max_context`) gets no reward (0)."""

    def __init__(self, prompt: EpisodePrompt) -> None:
        where = prompt.extra.get(EXTRA_KEY)
        if not isinstance(where, dict):
            raise ValueError(f"prompt {prompt.prompt_id!r} has no extra['verifiers']: not a verifiers task")
        self.task = rebuild_task(where["env"], where["task"])
        self.own, self.shared = task_toolsets(self.task, where["env"])
        self.messages: list[tuple[Any, bool]] = opening_messages(self.task.data)
        self.toolbox = Toolbox([])
        self.turns = 0

    async def reset(self) -> Observation:
        self.toolbox = await open_toolbox(self.own, self.shared, self.task)
        return Observation(messages=prompt_messages(self.task.data), tools=self.toolbox.schemas)

    async def step(self, action: str) -> StepResult:
        import verifiers.v1 as vf

        turn = parse_tool_calls(action)
        ids = [f"call_{self.turns}_{i}" for i in range(len(turn.calls))]
        self.turns += 1
        self.messages.append((sampled_message(action, turn, ids), True))
        if turn.is_final:
            reward = await score(self.task, self.messages)
            return StepResult(reward=reward, done=True, info={"tool_calls": 0.0, "tool_errors": 0.0,
                                                               "parse_errors": 0.0})
        errors_before = self.toolbox.errors
        out = [{**r, "tool_call_id": i} for i, r in zip(ids, await self.toolbox.call_all(turn.calls), strict=True)]
        self.messages += [(vf.ToolMessage(tool_call_id=m["tool_call_id"], name=m["name"], content=m["content"]), False)
                          for m in out]
        if turn.errors:
            out.append(format_error_message(turn.errors))
            self.messages.append((vf.UserMessage(content=out[-1]["content"]), False))
        info = {"tool_calls": float(len(turn.calls)), "tool_errors": float(self.toolbox.errors - errors_before),
                "parse_errors": float(len(turn.errors))}
        return StepResult(messages=out, info=info, feedback=mistakes(out))

    async def close(self) -> None:
        await close_toolsets([*self.own, *self.shared])
        self.own, self.shared = [], []


def sampled_message(text: str, turn: ParsedTurn, ids: list[str]) -> Any:
    """A policy turn as the verifiers assistant message the endpoint would have served: its calls (ids `ids`)
    and the text outside them, or, with a malformed call, all text."""
    import verifiers.v1 as vf

    if turn.errors or not turn.calls:
        return vf.AssistantMessage(content=text if turn.errors else turn.content)
    calls = [vf.ToolCall(id=i, name=c.name, arguments=json.dumps(c.arguments)) for i, c in zip(ids, turn.calls,
                                                                                                 strict=True)]
    return vf.AssistantMessage(content=turn.content, tool_calls=calls)


class VerifiersEpisodes(VerifiersEnvironment):
    """A verifiers environment whose tasks are also played as episodes (`EpisodeEnvironment`): what
    `run.environment: {kind: verifiers}` loads; only `run.rollout.kind: multi_turn` asks it for sessions."""

    def session(self, prompt: EpisodePrompt, seed: int) -> VerifiersSession:
        """A new episode of `prompt`'s task (`seed` is unused: the loop draws nothing)."""
        return VerifiersSession(prompt)
