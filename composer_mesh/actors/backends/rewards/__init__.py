"""The rewarder bindings: what the rewarder actor needs of one (`base.RewardBackend`), the `python` rewarder and the
pool of worker processes that runs its functions."""
