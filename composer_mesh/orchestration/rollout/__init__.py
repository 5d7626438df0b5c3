"""Rollout drivers: how a generator's share of a step becomes finished, scored groups (`base.RolloutDriver`).

`single_turn.SingleTurnRollout` makes one completion per sample; `multi_turn.MultiTurnRollout` plays an episode
per sample against the run's environment (`episode.py` one episode, `turns.py` the generators' turn queue,
`teacher_episodes.py` replay teachers playing the same tasks). `choose.rollout_factory` picks one from
`run.rollout.kind`; another kind is one more module here, passed to `RLLoop(rollout=...)`.
"""
