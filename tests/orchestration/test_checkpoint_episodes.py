"""A controller checkpoint holding finished-but-untrained episodes: `Rollout.turns` and `status` round-trip."""

from __future__ import annotations

import json

import pytest
import torch

from composer_mesh.actors.messages import Prompt, RewardResult, Rollout, RolloutGroup, ScoredGroup, Turn
from composer_mesh.orchestration.checkpoint import decode, encode


def test_an_episode_round_trips_through_json_and_tensors():
    turns = [Turn(0, 2, True, weight_version=3), Turn(2, 5, False, reward=0.5), Turn(5, 6, True, weight_version=4)]
    episode = Rollout("p0", [1, 2], [3, 4, 5, 6, 7, 8], [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3], 3, text="a",
                      turns=turns, status="truncated_context")
    plain = Rollout("p0", [1, 2], [9], [-0.5], 3)
    group = ScoredGroup(RolloutGroup(Prompt("p0", "q", [1, 2], tools=[{"name": "f"}]), [episode, plain]),
                        [RewardResult(1.0), RewardResult(0.0)])
    tensors: dict[str, torch.Tensor] = {}
    back = decode(json.loads(json.dumps(encode([group], tensors))), tensors)[0]
    got, got_plain = back.group.rollouts
    assert got == episode and got_plain == plain and back.group.prompt == group.group.prompt
    assert all(type(t) is Turn for t in got.turns) and got.status == "truncated_context"
    assert got.loss_mask() == [1, 1, 0, 0, 0, 1] and got_plain.turns is None


def test_decoding_an_episode_checks_its_turns():
    """A checkpoint is data: a Rollout whose turns do not tile its tokens is refused when decoded, not trained."""
    tree = encode(Rollout("p0", [1], [3, 4], [-0.1, 0.0], 1, turns=[Turn(0, 1, True), Turn(1, 2, False)]), {})
    tree["turns"][1]["end"] = 3
    with pytest.raises(ValueError, match="turns cover 3 of 2 completion tokens"):
        decode(json.loads(json.dumps(tree)), {})


def test_segments_of_an_episode_round_trip_and_older_checkpoints_read_as_whole_episodes():
    segment = Rollout("p0", [1], [3], [-0.1], 1, turns=[Turn(0, 1, True)], episode_id="p0/7", segment=1)
    tree = encode(segment, {})
    back = decode(json.loads(json.dumps(tree)), {})
    assert back == segment and (back.episode_id, back.segment, back.opens_episode) == ("p0/7", 1, False)
    older = {k: v for k, v in tree.items() if k not in ("episode_id", "segment")}  # written before segments
    assert (decode(older, {}).episode_id, decode(older, {}).segment) == (None, 0)
    tree["episode_id"] = None
    with pytest.raises(ValueError, match="segment 1 needs an episode_id"):
        decode(json.loads(json.dumps(tree)), {})
