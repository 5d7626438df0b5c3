"""An async orchestration script written against the mesh: what `composer-mesh run` does, spelled out.

    python examples/grpo_async.py topologies/local.yaml --steps 20

Generation runs in its own task per generator and overlaps training; rollouts older than
`max_policy_lag` versions are dropped and counted. Swap the teachers binding in the topology
(hf / vllm / openrouter) and this script does not change.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from composer_mesh.api import (
    GenerationRequest,
    LagGate,
    PromptSource,
    TeacherRequest,
    TrainBatch,
    launch,
    load_topology,
    merge_signals,
)


async def main(path: str, steps: int) -> None:
    topo = load_topology(path)
    cfg = topo.run
    prompts = PromptSource(cfg.task, seed=cfg.seed)
    gate = LagGate(cfg.max_policy_lag)
    queue: asyncio.Queue[TrainBatch] = asyncio.Queue(maxsize=cfg.rollout_queue_size)

    async with launch(topo) as mesh:
        # Build models everywhere at once; the trainer publishes version 1 and generators pull it.
        manifest, *_ = await asyncio.gather(
            mesh.trainer.setup.call_one(), mesh.generators.setup.call(), mesh.teachers.setup.call()
        )
        await mesh.generators.update_weights.call(manifest)
        version = manifest.version
        generators = mesh.procs("generators")  # one handle per generator proc

        async def rollouts(generator) -> None:
            while True:
                request = GenerationRequest(prompts.take(cfg.prompts_per_step), cfg.samples_per_prompt,
                                            cfg.max_new_tokens, cfg.temperature)
                groups = await generator.generate.call_one(request)
                flat = [r for g in groups for r in g.rollouts]
                scored, answers = await asyncio.gather(
                    mesh.rewarder.score.call_one(groups),
                    mesh.teachers.signals.call(TeacherRequest(rollouts=flat, prompts=[g.prompt for g in groups],
                                                              max_new_tokens=cfg.max_new_tokens)),
                )
                signals = merge_signals(list(answers.values()), len(flat))
                await queue.put(TrainBatch(scored, signals.distributions, signals.traces))

        tasks = [asyncio.create_task(rollouts(g)) for g in generators]
        try:
            step = 0
            while step < steps:
                batch = await queue.get()
                if not gate.admit(batch, version):
                    continue
                t0 = time.perf_counter()
                metrics, manifest = await mesh.trainer.train_step.call_one(batch)
                await mesh.generators.update_weights.call(manifest)  # one-sided pulls, in parallel
                version, step = manifest.version, step + 1
                print(f"step {step:3d}  v{version}  reward {metrics.metrics['reward_mean']:.2f}  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in metrics.channels.items())
                      + f"  dropped {gate.dropped_batches}  {time.perf_counter() - t0:.2f}s")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topology")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.topology, args.steps))
