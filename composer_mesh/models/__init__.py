"""Model building: the tiny offline model and tokenizer, and loading local transformers checkpoints."""
