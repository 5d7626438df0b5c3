"""The trainer -> generator weight plane: `config` (the `weights:` section, cheap) and `plane` (publisher, subscriber)."""
