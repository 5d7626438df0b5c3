"""LossConfig: bad values are rejected with errors that name the field (and the allowed values)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from composer_mesh.loss.config import LossConfig, loss_config_table


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("sdpo_wrapper", "tiad", "'none', 'taid', 'entropy_opd'"),
        ("dpo_variant", "ipo", "'dpo', 'simpo'"),
        ("normalization", "seq", "'token', 'sequence'"),
        ("entropy_opd_gate", "soft", "'hard', 'linear'"),
        ("off_policy_correction", "is", "'none', 'tis'"),
        ("credit", "turn", "'episode', 'discounted_return', 'turn_group'"),
    ],
)
def test_unknown_variant_lists_allowed_values(field: str, value: str, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        LossConfig(**{field: value})
    text = str(info.value)
    assert field in text and needle in text and repr(value) in text


@pytest.mark.parametrize(
    "field",
    [
        "alpha_sdpo",
        "beta_replay",
        "kl_beta",
        "eps_low",
        "eps_high",
        "replay_dpo_beta",
        "simpo_beta",
        "simpo_gamma",
    ],
)
def test_negative_weights_rejected_naming_field(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        LossConfig(**{field: -0.1})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sdpo_jsd_beta": 1.5}, "sdpo_jsd_beta"),
        ({"taid_t": -0.1}, "taid_t"),
        ({"sdpo_temperature": 0.0}, "sdpo_temperature"),
        ({"sdpo_chunk_tokens": 0}, "sdpo_chunk_tokens"),
        ({"taid_t_start": 0.9, "taid_t_end": 0.5}, "taid_t_start"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"sdpo_token_clip": -1.0}, "sdpo_token_clip"),
        ({"entropy_opd_h_max": 0.0}, "entropy_opd_h_max"),
        ({"alpah_sdpo": 1.0}, "alpah_sdpo"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"tis_cap": -1.0}, "tis_cap"),
        ({"tis_cap": float("inf")}, "tis_cap"),
        ({"credit": "turn_group", "credit_gamma": 0.0}, "credit_gamma"),
        ({"credit": "discounted_return", "credit_gamma": 1.5}, "credit_gamma"),
        ({"credit": "turn_group", "credit_gamma": float("nan")}, "credit_gamma"),
        ({"credit_gamma": 0.9}, "credit_gamma"),  # a discount nothing reads: credit is 'episode'
    ],
)
def test_out_of_range_rejected_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        LossConfig(**kwargs)


def test_every_field_documented_and_in_table() -> None:
    table = loss_config_table()
    for name, field in LossConfig.model_fields.items():
        assert field.description, name
        assert f"`{name}`" in table


def test_yaml_style_dict_roundtrip() -> None:
    cfg = LossConfig.model_validate({"alpha_sdpo": 0.5, "sdpo_wrapper": "taid", "taid_t": 0.3})
    assert LossConfig.model_validate(cfg.model_dump()) == cfg


def test_off_policy_correction_defaults_and_accepts_tis() -> None:
    cfg = LossConfig()
    assert cfg.off_policy_correction == "none" and cfg.tis_cap == 2.0
    tis = LossConfig.model_validate({"off_policy_correction": "tis", "tis_cap": 1.5})
    assert tis.off_policy_correction == "tis" and tis.tis_cap == 1.5
