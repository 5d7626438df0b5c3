"""Models: the policy's config, the tiny offline model and tokenizer, and loading local transformers checkpoints.

Modules, each importing only those above it:
- `config`: `ModelConfig`, `WarmStartConfig`, `LoraConfig` (cheap: pydantic only);
- `tokenizer`: the tiny character-level tokenizer, `encode_checked`, `stop_token_ids`;
- `chat`: a prompt's token ids (chat template for messages) and a model's stop ids, for every binding;
- `sampling`: batched sampling and teacher-forced logits for any transformers causal LM;
- `tiny`: the tiny Qwen2 itself (`build_tiny`);
- `warmstart`: brief SFT on a task and greedy task accuracy;
- `loading`: what every role calls to get its model (`materialize`, `load_pretrained`, `load_tokenizer`,
  `named_weights`);
- `lora`: LoRA adapters via peft (`apply_lora`, `merged_weights`, `adapter_weights`, `load_adapter_weights`,
  `adapter_disabled`, `save_adapter`).
All but `config` import torch/transformers and are imported where used.
"""

from composer_mesh.models.config import LoraConfig, ModelConfig, WarmStartConfig

__all__ = ["LoraConfig", "ModelConfig", "WarmStartConfig"]
