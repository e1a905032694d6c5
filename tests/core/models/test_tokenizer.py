import pytest
from grpo_core.tokenizer import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    apply_chat_template,
    build_char_tokenizer,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_characters_round_trip(tokenizer):
    text = "Natalia sold 48/2 = 24 clips.\n#### 72"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert tokenizer.pad_token == ENDOFTEXT and tokenizer.eos_token == IM_END
    ids = tokenizer(f"{IM_START}a{IM_END}")["input_ids"]
    assert ids == [1, tokenizer.convert_tokens_to_ids("a"), 2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a"


def test_unknown_character_maps_to_unk(tokenizer):
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]


def test_chat_template_is_chatml(tokenizer):
    text = apply_chat_template(
        tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"


def test_left_padding(tokenizer):
    batch = tokenizer(["ab", "abcd"], padding=True)
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2


def test_save_and_load_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "What is 6*7?"}]
    assert apply_chat_template(loaded, messages) == apply_chat_template(tokenizer, messages)
    assert (
        loaded(apply_chat_template(loaded, messages))["input_ids"]
        == tokenizer(apply_chat_template(tokenizer, messages))["input_ids"]
    )
    assert loaded.padding_side == "left" and len(loaded) == len(tokenizer)


def test_load_tokenizer_missing_dir_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot load a tokenizer from"):
        load_tokenizer(tmp_path / "nope")


def test_saved_char_tokenizer_next_to_a_qwen2_config_keeps_its_vocabulary(tokenizer, tmp_path):
    # A run export puts config.json (model_type qwen2) beside the tokenizer; AutoTokenizer
    # alone would load the byte-level Qwen2 tokenizer and drop "\n".
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    loaded = load_tokenizer(tmp_path)
    text = "3+5=\n8"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
