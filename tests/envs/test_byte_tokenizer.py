"""The tiny model's byte-level tokenizer option (`model.tokenizer: byte`): any text, a chat template, stop ids,
the same tokenizer after a save/reload, and the character tokenizer's configs (cache keys) left as they were."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from composer_mesh.actors.messages import Prompt
from composer_mesh.models.chat import chat_end_token_id, model_stop_ids, prompt_token_ids
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.tiny import build_tiny
from composer_mesh.models.tokenizer import EOS_TOKEN, IM_END, IM_START, build_byte_tokenizer, encode_checked

BYTE = ModelConfig(tokenizer="byte")


def test_every_byte_is_one_id_and_any_text_round_trips() -> None:
    tok = build_byte_tokenizer()
    assert len(tok) == 259
    assert [tok.convert_tokens_to_ids(t) for t in (EOS_TOKEN, IM_START, IM_END)] == [256, 257, 258]
    assert tok.eos_token_id == tok.pad_token_id == 256
    text = "Calculate 3 + 7.\n\tÜber 日本 🙂 <answer>10</answer> {a: [1, 2]} ~`|\\"
    ids = encode_checked(tok, text)  # raises unless the ids decode back to the text
    assert ids == list(text.encode("utf-8"))  # id b is byte b: nothing dropped, no merges


def test_chat_template_renders_qwen_turns_and_ends_a_turn_with_im_end() -> None:
    tok = build_byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 3 + 7."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCalculate 3 + 7.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = prompt_token_ids(tok, Prompt("p0", "Calculate 3 + 7.", [], messages=messages))
    assert ids == tok.encode(text, add_special_tokens=False)  # special tokens in text are matched too
    assert ids[0] == 257 and ids.count(258) == 2
    assert chat_end_token_id(tok) == 258
    assert prompt_token_ids(tok, Prompt("p1", "3+4=", [])) == list(b"3+4=")  # a text prompt is as before


def test_tiny_byte_model_is_sized_to_the_tokenizer_and_stops_at_eos_and_end_of_turn(tmp_path) -> None:
    from transformers import AutoTokenizer

    model, tok = build_tiny(BYTE)
    assert model.config.vocab_size == len(tok) == 259
    assert model_stop_ids(tok, model.generation_config) == [256, 258]
    # A task's end marker is not a stop of the byte model (its generation config lists EOS and <|im_end|> only).
    assert model_stop_ids(tok, model.generation_config, skip_texts=(";",)) == [256, 258]
    tok.save_pretrained(str(tmp_path))
    back = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    messages = [{"role": "user", "content": "héllo"}]
    assert back.get_vocab() == tok.get_vocab() and back.chat_template == tok.chat_template
    assert prompt_token_ids(back, Prompt("p", "", [], messages=messages)) == prompt_token_ids(
        tok, Prompt("p", "", [], messages=messages))
    assert model_stop_ids(back, model.generation_config) == [256, 258]


def test_the_character_tokenizer_stays_the_default_with_unchanged_dumps_and_cache_keys() -> None:
    plain = ModelConfig()
    assert plain.tokenizer == "char" and "tokenizer" not in plain.model_dump()
    # The key a default config had before the option existed (materialized models are reused, not rebuilt).
    assert plain.cache_key() == "f999d765841e192a"
    assert ModelConfig.model_validate(BYTE.model_dump()) == BYTE and BYTE.model_dump()["tokenizer"] == "byte"
    assert BYTE.cache_key() != plain.cache_key()
    _, char_tok = build_tiny(plain)
    assert len(char_tok) < 30 and not char_tok.chat_template


def test_byte_tokenizer_is_for_the_tiny_model_only(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValidationError, match="tokenizer='byte' is for the tiny model"):
        ModelConfig(source=str(tmp_path), tokenizer="byte")


def test_warm_start_prompts_are_the_chat_prompts_token_for_token() -> None:
    """A warm start encodes the task's prompt text; the generators render the same prompt's messages with the
    chat template: both must be the same ids, or the warm start trains on prompts RL never shows."""
    from composer_mesh.envs.reasoning_gym import messages_for
    from composer_mesh.envs.tasks import TINY_ADDITION, ReasoningGymTask

    task = ReasoningGymTask(TINY_ADDITION)
    tok = build_byte_tokenizer()
    rng = random.Random(0)
    for split in ("train", "eval"):
        text, answer = task.sample(rng, split)
        question = text.split("user\n", 1)[1].split(IM_END, 1)[0]
        chat = Prompt("p", question, [], messages=messages_for(TINY_ADDITION, question))
        assert tok.encode(text, add_special_tokens=False) == prompt_token_ids(tok, chat)
        target = task.target(answer)
        assert target == f"<answer>{answer}</answer>{IM_END}"
        assert tok.encode(target, add_special_tokens=False)[-1] == 258  # ends the turn: a stop id
        assert task.reward(text, target.removesuffix(IM_END), answer) == 1.0
