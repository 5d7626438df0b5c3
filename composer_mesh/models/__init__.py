"""Model building: the tiny offline model and tokenizer, and loading local transformers checkpoints.

`config` (ModelConfig) is cheap to import; `tiny` (materialize, load_pretrained, load_tokenizer),
`warmstart` and `sampling` import torch/transformers and are imported where used.
"""

from composer_mesh.models.config import ModelConfig, WarmStartConfig

__all__ = ["ModelConfig", "WarmStartConfig"]
