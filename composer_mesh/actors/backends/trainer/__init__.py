"""The trainer bindings: what the trainer actor needs of one (`base.TrainerBackend`), the `hf` trainer, its full
training state, and the pure batch -> loss code it serves (`train_batch.py`)."""
