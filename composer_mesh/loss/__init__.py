"""The three-channel RL loss. Pure torch: never imports Monarch."""
