"""A verifiers 0.4 taskset for tests/envs/test_verifiers_agent.py: a prompt that opens with a tool call and its
result (what verifiers' Messages prompts may hold), and two tools, one that echoes and one that raises. Its reward
reads the trace: 1 when the `explode` tool's failure came back to the policy as an error tool message.
`broken_prompt: true`: the opening's tool result answers a call nobody made (refused, naming the task)."""

import verifiers.v1 as vf


class ToyTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "toy"  # the tools are `toy_echo` and `toy_explode`, as verifiers' chat program names them

    @vf.tool
    def echo(self, text: str) -> str:
        """Return the text unchanged."""  # no Args section: the schema is the MCP server's
        return text

    @vf.tool
    async def explode(self, reason: str) -> str:
        """Fail.

        Args:
            reason: why.
        """
        raise RuntimeError(f"boom: {reason}")


class ToyConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ToyTask(vf.Task[vf.TaskData, vf.State, ToyConfig]):
    @classmethod
    def toolsets(cls, config: ToyConfig) -> list[vf.Toolset]:
        return [ToyTools(config.tools)]

    @vf.reward
    async def saw_the_error(self, trace: vf.Trace) -> float:
        """1 when a tool result after the opening says `toy_explode` failed."""
        tools = [n.message for n in trace.nodes[len(self.data.prompt):] if n.message.role == "tool"]
        return float(any(str(m.content).startswith("error: toy_explode: RuntimeError: boom") for m in tools))


class ToyTasksetConfig(vf.TasksetConfig):
    broken_prompt: bool = False
    task: ToyConfig = ToyConfig()


class ToyTaskset(vf.Taskset[ToyTask, ToyTasksetConfig]):
    def load(self) -> list[ToyTask]:
        answered = "nobody" if self.config.broken_prompt else "c0"
        return [ToyTask(vf.TaskData(prompt=[
            vf.UserMessage(content=f"echo {word}, then explode"),
            vf.AssistantMessage(tool_calls=[vf.ToolCall(id="c0", name="toy_echo", arguments=f'{{"text": "{word}"}}')]),
            vf.ToolMessage(tool_call_id=answered, content=word),
            vf.UserMessage(content="now explode"),
        ]), self.config.task) for word in ("hi", "yo", "ok", "no")]


__all__ = ["ToyTaskset"]
