"""Rollout drivers: how a generator's share of a step becomes finished, scored groups (`base.RolloutDriver`).

`single_turn.SingleTurnRollout` is the built-in one (one completion per sample). A driver of another kind (a
multi-turn episode with tool calls, say) is one more module here, passed to `RLLoop(rollout=...)`.
"""
