"""ModelConfig validation: bad input names the field and what is allowed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from composer_mesh.models.config import ModelConfig


def test_defaults_are_tiny_without_warmstart():
    cfg = ModelConfig()
    assert cfg.is_tiny and cfg.warmstart is None and cfg.hidden_size // cfg.num_heads == 32


def test_missing_source_path_names_the_field(tmp_path):
    with pytest.raises(ValidationError, match=r"model\.source .*nope.* neither 'tiny' nor an existing directory"):
        ModelConfig(source=str(tmp_path / "nope"))


def test_source_dir_without_config_json(tmp_path):
    with pytest.raises(ValidationError, match=r"model\.source .* has no config\.json"):
        ModelConfig(source=str(tmp_path))


def test_source_dir_with_config_json_is_accepted_and_resolved(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert ModelConfig(source=str(tmp_path)).source == str(tmp_path.resolve())


def test_heads_must_divide():
    with pytest.raises(ValidationError, match=r"model\.num_heads=3 must divide model\.hidden_size=64"):
        ModelConfig(num_heads=3)
    with pytest.raises(ValidationError, match=r"model\.num_kv_heads=3 must divide model\.num_heads=2"):
        ModelConfig(num_kv_heads=3)


def test_unknown_fields_and_bad_values_are_rejected():
    with pytest.raises(ValidationError, match="hidden"):
        ModelConfig(hidden=64)
    with pytest.raises(ValidationError, match=r"warmstart\.steps"):
        ModelConfig(warmstart={"steps": -1})
    with pytest.raises(ValidationError, match="dtype"):
        ModelConfig(dtype="float64")
    with pytest.raises(ValidationError, match=r"warmstart\.epochs"):
        ModelConfig(warmstart={"epochs": 1})


def test_cache_key_covers_every_field():
    base = ModelConfig()
    assert base.cache_key() == ModelConfig().cache_key()
    variants = [ModelConfig(seed=1), ModelConfig(hidden_size=128, num_heads=4), ModelConfig(warmstart={}),
                ModelConfig(warmstart={"steps": 5}), ModelConfig(warmstart={"episodes": "whole"}),
                ModelConfig(dtype="bfloat16")]
    keys = {v.cache_key() for v in variants} | {base.cache_key()}
    assert len(keys) == len(variants) + 1


def test_fields_added_later_at_their_defaults_keep_older_cache_keys():
    """`warmstart.data: null` and `warmstart.episodes: turn` are left out of the dump: models cached before those
    fields existed are found again (the key hashes the dump)."""
    assert "episodes" not in ModelConfig(warmstart={"episodes": "turn"}).model_dump(mode="json")["warmstart"]
    assert ModelConfig(warmstart={"episodes": "turn"}).cache_key() == ModelConfig(warmstart={}).cache_key()
    assert ModelConfig(warmstart={"episodes": "whole"}).model_dump(mode="json")["warmstart"]["episodes"] == "whole"


def test_every_field_has_a_description():
    from composer_mesh.models.config import WarmStartConfig

    for model in (ModelConfig, WarmStartConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_whole_episode_warm_starts_need_a_task_that_demonstrates_episodes():
    """`warmstart.episodes: whole` on a task without demonstrated episodes is refused in one line naming both."""
    from composer_mesh.models.loading import build_tiny
    from composer_mesh.models.warmstart import warm_start

    config = ModelConfig(warmstart={"task": "addition", "steps": 1, "episodes": "whole"})
    model, tokenizer = build_tiny(config)
    with pytest.raises(ValueError, match=r"warmstart\.episodes: whole needs a task that demonstrates episodes .* "
                       r"task 'addition' has none"):
        warm_start(model, tokenizer, config.warmstart)
