"""Products of two numbers through a `calculator` tool, as a verifiers 0.4 taskset with a toolset; `split: eval` is
the calculator task's held-out eighth (`envs.calculator.held_out`), which its warm start never trains on.

Shipped so topologies/verifiers_tools.yaml runs from a checkout (`taskset: composer_mesh.envs.calculator_taskset`,
played by `composer_mesh.envs.verifiers_agent:play`); docs/verifiers.md shows this file. The tool is the
calculator environment's, with the same name and schema, so a model warm-started on that task calls it.
Imports verifiers: loaded only by a run that names it.
"""

import random
from collections.abc import Iterator

import verifiers.v1 as vf

from composer_mesh.envs.calculator import calculator, held_out


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is named `calculator`, not `calculator_toolset_calculator`

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers.

        Args:
            expression: integers with + - * / // % ** and parentheses, e.g. "47*83".
        """
        return calculator(expression)


class ProductData(vf.TaskData):
    answer: str


class ProductTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ProductTask(vf.Task[ProductData, vf.State, ProductTaskConfig]):
    @classmethod
    def toolsets(cls, config: ProductTaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.tools)]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the final answer is the product."""
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def tool_results(self, trace: vf.Trace) -> float:
        """How many tool results the episode got (errors included)."""
        return float(sum(node.message.role == "tool" for node in trace.nodes))


class ProductsConfig(vf.TasksetConfig):
    split: str = "train"
    size: int = 256
    task: ProductTaskConfig = ProductTaskConfig()


class ProductsTaskset(vf.Taskset[ProductTask, ProductsConfig]):
    def load(self) -> Iterator[ProductTask]:
        rng = random.Random(f"composer-mesh/calculator_taskset/{self.config.split}")
        made = 0
        while made < self.config.size:
            a, b = (rng.randint(10, 999) for _ in range(2))
            if held_out(a, b) == (self.config.split == "eval"):
                made += 1
                yield ProductTask(ProductData(prompt=f"{a}*{b}", answer=str(a * b)), self.config.task)


__all__ = ["ProductsTaskset"]

if __name__ == "__main__":  # verifiers' own rollouts serve the toolset as `python -m <this module>`
    CalculatorToolset.run()
