"""The bindings: plain classes (no Monarch) the role actors delegate to, one room per role.

`trainer/` (the `hf` trainer, its full training state, and `train_batch.py`, the pure batch -> loss code it
serves), `generation/` (the `hf` and `vllm` generators, the vLLM engine they share with the vllm teacher, the
fixed-latency stand-in), `teachers/` (the `hf`, `vllm` and `openrouter` teachers, what the local ones share,
the OpenRouter HTTP client), `rewards/` (the `python` rewarder and its worker-process pool). Each room's
`base.py` is the Protocol its actor needs of a binding and its `config.py` the bindings' `Settings`, import-cheap
so that validating a topology imports neither torch nor the bindings. `local_model.py` and `config.py` here
hold what the bindings that run a local copy of a model share across rooms.
"""
