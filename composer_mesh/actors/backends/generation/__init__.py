"""The generator bindings: what the generator actor needs of one (`base.GeneratorBackend`), the `hf` and `vllm`
generators, the vLLM engine (shared with the vllm teacher) and the fixed-latency stand-in for scaling tests."""
