from __future__ import annotations

import pytest

from aligner.tasks import get_task
from aligner.tasks.digits import match_score, reverse_reward, sort_reward
from aligner.tokenizers import CharTokenizer, build_tokenizer


def test_char_tokenizer_roundtrip_and_specials():
    tok = CharTokenizer()
    assert tok.pad_id != tok.eos_id
    ids = tok.encode("3141:")
    assert tok.decode(ids) == "3141:"
    assert tok.decode(ids + [tok.eos_id, tok.pad_id, tok.pad_id]) == "3141:"
    assert tok.decode([tok.eos_id], skip_special=False) == "<eos>"
    assert tok.vocab_size == 14


def test_char_tokenizer_errors():
    with pytest.raises(ValueError, match="character 'x' in '12x'"):
        CharTokenizer().encode("12x")
    with pytest.raises(ValueError, match="token id 99"):
        CharTokenizer().decode([99])
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("aa")
    with pytest.raises(ValueError, match="tokenizer='nope'"):
        build_tokenizer("nope")


def test_fingerprint_depends_on_alphabet():
    assert CharTokenizer("01").fingerprint() != CharTokenizer("012").fingerprint()
    assert build_tokenizer("char").fingerprint() == CharTokenizer().fingerprint()


def test_hf_tokenizer_from_local_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(tmp_path)
    tok = build_tokenizer(str(tmp_path))
    assert tok.vocab_size == 5 and tok.eos_id == 1 and tok.pad_id == 0
    assert tok.decode(tok.encode("abc")).replace(" ", "") == "abc"
    assert tok.fingerprint().startswith("hf:")


def test_match_score_hand_worked():
    assert match_score("1234", "1234") == 1.0
    assert match_score("1243", "1234") == 0.5  # positions 0,1 agree out of 4
    assert match_score("12", "1234") == 0.5  # too short: 2 of max(2, 4) positions
    assert match_score("123456", "1234") == 4 / 6  # too long is penalised the same way
    assert match_score("", "") == 1.0


def test_task_rewards():
    assert sort_reward(["3141:"], ["1134"]) == [1.0]
    assert reverse_reward(["3141:"], ["1413"]) == [1.0]
    assert sort_reward(["3141:", "9870:"], ["4311", "0789"]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="no ':' separator"):
        sort_reward(["3141"], ["1134"])
    with pytest.raises(ValueError, match="1 prompts but 2 responses"):
        sort_reward(["1:"], ["1", "2"])


def test_task_prompts_and_chance():
    task = get_task("sort", 6)
    a, b = task.prompts(8, seed=1), task.prompts(8, seed=1)
    assert a == b and all(len(p) == 7 and p.endswith(":") for p in a)
    assert task.target("3141:") == "1134" and task.max_response_tokens == 7
    with pytest.raises(ValueError, match="task='add'"):
        get_task("add")
