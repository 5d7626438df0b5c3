"""Single-digit sums as a verifiers 0.4 taskset; `split: eval` is the `addition` task's held-out fifth.

Shipped so topologies/verifiers.yaml runs from a checkout (`taskset: composer_mesh.envs.addition_taskset`);
docs/verifiers.md shows this file. Imports verifiers: loaded only by a run that names it.
"""

from collections.abc import Iterator

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply before its first ';' is the sum (the tiny model ends its answers with ';')."""
        return float(trace.last_reply.split(";")[0].strip() == self.data.answer)


class AdditionConfig(vf.TasksetConfig):
    split: str = "train"


class AdditionTaskset(vf.Taskset[SumTask, AdditionConfig]):
    def load(self) -> Iterator[SumTask]:
        for a in range(10):
            for b in range(10):
                if ((a + 2 * b) % 5 == 4) == (self.config.split == "eval"):
                    yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["AdditionTaskset"]
