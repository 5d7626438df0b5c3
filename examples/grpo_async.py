"""An async orchestration script written against the mesh: what `composer-mesh run` does, spelled out.

    python examples/grpo_async.py topologies/local.yaml --steps 20

The `StepScheduler` paces generation by the policy-lag bound: a step's prompts are sampled only once the
generators hold weights at most `max_policy_lag` versions behind the version that will train on them, so
nothing is generated to be thrown away (lag 0 = synchronous). Each generator takes chunks of admitted steps;
each chunk is scored and sent to the teachers while the generator goes on. Swap the teachers binding in the
topology (hf / vllm / openrouter) and this script does not change.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from composer_mesh.api import (
    Chunk,
    GenerationRequest,
    GroupResult,
    StepScheduler,
    TeacherRequest,
    TrainBatch,
    launch,
    load_topology,
    merge_signals,
    prompt_source,
    row_seed,
)


async def main(path: str, steps: int) -> None:
    topo = load_topology(path)
    cfg = topo.run
    prompts = prompt_source(cfg)  # run.data or run.task: a train stream and a disjoint eval set

    async with launch(topo) as mesh:
        # Build models everywhere at once; the trainer publishes version 1 and generators pull it.
        manifest, *_ = await asyncio.gather(
            mesh.trainer.setup.call_one(), mesh.generators.setup.call(), mesh.teachers.setup.call()
        )
        await mesh.generators.update_weights.call(manifest)
        generators = mesh.procs("generators")  # one handle per generator proc
        schedule = StepScheduler(prompts.take, steps=steps, groups_per_step=cfg.prompts_per_step,
                                 generators=len(generators), max_policy_lag=cfg.max_policy_lag)

        async def complete(chunk: Chunk, groups) -> None:
            flat = [r for g in groups for r in g.rollouts]
            scored, answers = await asyncio.gather(
                mesh.rewarder.score.call_one(groups),
                mesh.teachers.signals.call(TeacherRequest(rollouts=flat, prompts=[g.prompt for g in groups],
                                                          max_new_tokens=cfg.max_new_tokens)),
            )
            signals = merge_signals(list(answers.values()), len(flat))
            n = cfg.samples_per_prompt
            await schedule.finish(chunk, [
                GroupResult(chunk.first + i, g, signals.distributions[i * n:(i + 1) * n],
                            [t for t in signals.traces if t.prompt_id == g.group.prompt.prompt_id])
                for i, g in enumerate(scored)
            ])

        async def generate(generator) -> None:
            while True:
                chunk = await schedule.next_chunk()  # waits while the lag bound admits nothing new
                request = GenerationRequest(chunk.prompts, cfg.samples_per_prompt, cfg.max_new_tokens,
                                            cfg.temperature, seed=row_seed(cfg.seed, chunk.first, cfg.samples_per_prompt))
                groups = await generator.generate.call_one(request)
                tasks.append(asyncio.create_task(complete(chunk, groups)))

        tasks = [asyncio.create_task(generate(g)) for g in generators]
        try:
            for step in range(1, steps + 1):
                results, _ = await schedule.take(step)
                batch = TrainBatch([r.group for r in results], [d for r in results for d in r.distributions],
                                   [t for r in results for t in r.traces])
                t0 = time.perf_counter()
                metrics, manifest = await mesh.trainer.train_step.call_one(batch)
                await mesh.generators.update_weights.call(manifest)  # one-sided pulls, in parallel
                await schedule.synced(step)  # admits the next step's prompts
                lag = manifest.version - 1 - min(r.weight_version for r in batch.rollouts())
                print(f"step {step:3d}  v{manifest.version}  reward {metrics.metrics['reward_mean']:.2f}  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in metrics.channels.items())
                      + f"  lag {lag}  {time.perf_counter() - t0:.2f}s")
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
