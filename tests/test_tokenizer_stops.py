"""Stop ids of real Hugging Face models and chat-template variables: a tokenizer folder's
``generation_config.json`` end ids (an int or a list, as instruct models write them) become the
tokenizer's ``stop_ids``; ``generation.stop_token_ids`` adds to them and is checked against the
vocabulary; the native engine's loop ends a row at any stop id (its lengths, ``ended`` and response
mask); the TensorRT-LLM requests and the server's and actor's response texts stop at them too; and
``data.chat_template_kwargs`` reach ``apply_chat_template``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from _generation_parts import MAX_LEN, TOK, tiny_model
from _word_tokenizer import save_word_tokenizer

from aligner import distributed
from aligner.actor.config import ActorConfig, validate_actor_config
from aligner.actor.critic_link import sample_texts
from aligner.actor.datasets import DataConfig, training_prompt_set
from aligner.config_checks import ConfigError
from aligner.critic.reward_fn import split_samples
from aligner.generation import NativeEngine, SamplingParams
from aligner.generation.config import GenerationConfig
from aligner.generation.engine import GenerationOutput, engine_stop_ids
from aligner.generation.ragged import ragged_decode
from aligner.generation.trtllm.requests import sampling_kwargs
from aligner.tokenizers import CharTokenizer, HFTokenizer, build_tokenizer

warnings.filterwarnings("ignore", category=UserWarning)

WORDS = "what is two plus four say hi a b c".split()
SPECIALS = ["<pad>", "<unk>", "</s>", "<|im_end|>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<think>"]
ID = {w: i for i, w in enumerate(SPECIALS + WORDS)}
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %} <think> </think>{% endif %}"
    "{% endif %}"
)


def _hf_folder(folder, eos_ids=None, template: str | None = None) -> str:
    """A word-level HF tokenizer folder (eos ``</s>``), with a ``generation_config.json`` whose
    ``eos_token_id`` is ``eos_ids`` when given."""
    save_word_tokenizer(folder, WORDS, template, SPECIALS)
    if eos_ids is not None:
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos_ids, "do_sample": True})
        )
    return str(folder)


# -- the tokenizers' stop ids -----------------------------------------------------------------


def test_generation_config_eos_ids_become_the_hf_tokenizers_stop_ids(tmp_path):
    two = [ID["<|im_end|>"], ID["<|endoftext|>"]]
    tok = build_tokenizer(_hf_folder(tmp_path / "list", eos_ids=two))
    assert tok.eos_id == ID["</s>"]  # the tokenizer's own eos stays the primary one (padding, appending)
    assert tok.stop_ids == (ID["</s>"], *two)
    # An int, and an eos the tokenizer already has, count once.
    tok = build_tokenizer(_hf_folder(tmp_path / "int", eos_ids=ID["</s>"]))
    assert tok.stop_ids == (ID["</s>"],)
    assert build_tokenizer(_hf_folder(tmp_path / "none")).stop_ids == (ID["</s>"],)
    # The policy's folder (init_from) when the tokenizer comes from another folder.
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "generation_config.json").write_text(json.dumps({"eos_token_id": [ID["<|endoftext|>"]]}))
    tok = build_tokenizer(str(tmp_path / "none"), str(policy))
    assert tok.stop_ids == (ID["</s>"], ID["<|endoftext|>"])
    assert CharTokenizer().stop_ids == (CharTokenizer().eos_id,)


def test_a_bad_generation_config_is_refused_naming_the_file(tmp_path):
    folder = _hf_folder(tmp_path / "bad", eos_ids=[ID["</s>"], 10_000])
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id=\[2, 10000\]: expected"):
        HFTokenizer(folder)


# -- generation.stop_token_ids ----------------------------------------------------------------


def test_stop_token_ids_are_checked_against_the_vocabulary_and_reach_sampling():
    cfg = ActorConfig()
    cfg.generation.stop_token_ids = [3, 99, -1, "x"]
    msg = "\n".join(cfg.problems(vocab_size=TOK.vocab_size))
    assert (
        "generation.stop_token_ids=[3, 99, -1, 'x']: expected token ids in the tokenizer's vocabulary "
        "[0, 14); [99, -1, 'x'] are not"
    ) in msg
    with pytest.raises(ConfigError, match=r"generation\.stop_token_ids="):
        validate_actor_config(cfg, vocab_size=TOK.vocab_size)
    cfg.generation.stop_token_ids = [3, 13]
    assert not any("stop_token_ids" in m for m in cfg.problems(vocab_size=TOK.vocab_size))
    assert GenerationConfig(stop_token_ids="3").problems() == [
        "generation.stop_token_ids='3': expected a list of token ids, each an integer >= 0"
    ]
    assert GenerationConfig(stop_token_ids=[-2]).problems() == [
        "generation.stop_token_ids=[-2]: expected token ids >= 0; [-2] are not"
    ]
    assert GenerationConfig(stop_token_ids=[7, 9]).sampling(seed=1).stop_token_ids == (7, 9)
    assert ActorConfig().generation.stop_token_ids == []


# -- the engines end a row at any stop id -----------------------------------------------------


class _Script:
    """A stepper whose every row emits a scripted token per step (one-hot logits): the native
    engine's ragged loop without a model."""

    def __init__(self, scripts: list[list[int]], vocab: int) -> None:
        self.scripts, self.vocab, self.k = scripts, vocab, 0
        self.order: list[int] = []

    def _logits(self) -> torch.Tensor:
        z = torch.zeros(len(self.order), self.vocab)
        for r, i in enumerate(self.order):
            z[r, self.scripts[i][self.k]] = 10.0
        self.k += 1
        return z

    def prefill(self, padded, lens):
        return self._logits()

    def __call__(self, tok):
        return self._logits()

    def rows_after(self, n_live):
        return None  # never compact: the rows stay where the loop put them


def test_the_ragged_loop_ends_a_row_at_any_stop_id_with_its_length_and_mask():
    eos, second = 1, 9
    prompts = [[2, 3], [4, 5, 6], [7]]
    scripts = [[3, 3, second, 3, 3], [eos, 3, 3, 3, 3], [4, 4, 4, 4, 4]]
    step = _Script(scripts, TOK.vocab_size)
    step.order = sorted(range(3), key=lambda i: -len(prompts[i]))  # the loop's order: longest first
    sampling = SamplingParams(max_new_tokens=5, greedy=True)
    tokens, lengths, logprobs, ended, plen = ragged_decode(
        step,
        prompts,
        sampling,
        None,
        vocab_size=TOK.vocab_size,
        pad_id=TOK.pad_id,
        stop_ids=torch.tensor(engine_stop_ids(eos, stop_ids=[second])),
        max_seq_len=MAX_LEN,
        check_every=1,
    )
    out = GenerationOutput(tokens, lengths, plen, logprobs, ended)
    assert out.responses() == [[3, 3, second], [eos], [4] * 5]
    assert out.ended.tolist() == [True, True, False]  # rollout/ended_fraction: 2/3
    assert out.response_lengths.tolist() == [3, 1, 5]
    assert out.response_mask().sum(1).tolist() == [3.0, 1.0, 5.0]


@pytest.fixture(scope="module")
def ps():
    state = distributed.initialize(distributed.ParallelConfig(), seed=1234)
    yield state
    distributed.destroy()


class _TwoEnds(CharTokenizer):
    """A character tokenizer with a second end id, as a tokenizer with a generation_config.json
    listing two has; its eos is never emitted by the tiny policy (outside the vocabulary)."""

    def __init__(self, second: int) -> None:
        super().__init__()
        self.eos_id = self.vocab_size + 5
        self.stop_ids = (self.eos_id, second)


@pytest.mark.parametrize("backend", ["lean", "megatron"])
def test_the_native_engine_stops_at_the_tokenizers_second_end_id(ps, backend):
    model = tiny_model(0)
    prompts = [[2, 3, 4], [5, 6, 7, 8]]
    never = _TwoEnds(second=TOK.vocab_size + 6)
    sp = SamplingParams(max_new_tokens=12, greedy=True)
    full = NativeEngine(model, never, max_seq_len=MAX_LEN, parallel_state=ps, backend=backend).generate(
        prompts, sp
    )
    assert not full.ended.any()
    second = full.responses()[0][3]
    tok = _TwoEnds(second)
    engine = NativeEngine(model, tok, max_seq_len=MAX_LEN, parallel_state=ps, backend=backend)
    assert engine.stop_ids == (tok.eos_id, second) and engine.eos_id == tok.eos_id
    out = engine.generate(prompts, sp)
    r = out.responses()[0]
    assert r[-1] == second and second not in r[:-1] and len(r) <= 4 and bool(out.ended[0])
    assert full.responses()[0][: len(r)] == r
    # An explicit eos other than the tokenizer's stands alone (the tests' "never stop" engines).
    alone = NativeEngine(model, tok, eos_id=tok.eos_id + 1, max_seq_len=MAX_LEN, parallel_state=ps)
    assert alone.stop_ids == (tok.eos_id + 1,)


def test_trtllm_requests_carry_every_stop_id():
    sp = SamplingParams(max_new_tokens=4, stop_token_ids=(11,))
    kw = sampling_kwargs(sp, seed=1, max_tokens=4, eos_id=0, pad_id=13, stop_ids=(0, 9))
    assert kw["stop_token_ids"] == [0, 9, 11] and kw["end_id"] == -1


def test_response_texts_stop_at_the_first_stop_id(tmp_path):
    tok = build_tokenizer(_hf_folder(tmp_path / "t", eos_ids=[ID["<|im_end|>"], ID["<|endoftext|>"]]))
    row = [ID["what"], ID["is"], ID["two"], ID["<|endoftext|>"], ID["a"], ID["</s>"]]
    tokens, lengths, pl = torch.tensor([row]), torch.tensor([6]), torch.tensor([2])
    assert split_samples(tokens, lengths, pl, tok.stop_ids)[1] == [[ID["two"]]]
    assert split_samples(tokens, lengths, pl, tok.eos_id)[1] == [row[2:5]]  # one id, as before
    assert sample_texts(tok, tokens, lengths, pl)[1] == ["two"]
    assert sample_texts(tok, tokens, lengths, pl, stop_ids=(ID["two"],))[1] == [""]


# -- data.chat_template_kwargs ----------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tok = build_tokenizer(_hf_folder(tmp_path / "chat", template=THINKING_TEMPLATE))
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "what is two plus two"}) + "\n")
    data = DataConfig(prompt_file=str(src), chat_template=True)
    plain = training_prompt_set(data, tok, 100, cache_dir=str(tmp_path / "cache")).prompts[0]
    assert plain.endswith("<|assistant|>") and "<think>" not in plain
    data.chat_template_kwargs = {"enable_thinking": False}
    assert not data.problems(8, MAX_LEN)
    off = training_prompt_set(data, tok, 100, cache_dir=str(tmp_path / "cache")).prompts[0]
    assert off.endswith("<|assistant|> <think> </think>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False) == (
        "<|user|> hi <|assistant|> <think> </think>"
    )


def test_chat_template_kwargs_need_a_chat_template(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    kw = {"enable_thinking": False}
    assert DataConfig(prompt_file=str(src), chat_template_kwargs=kw).problems(8, MAX_LEN) == [
        "data.chat_template_kwargs={'enable_thinking': False}: expected {} without data.chat_template=true "
        "(they are the chat template's variables)"
    ]
    assert DataConfig(prompt_file=str(src), chat_template=True, chat_template_kwargs={"bad key": 1}).problems(
        8, MAX_LEN
    ) == [
        "data.chat_template_kwargs={'bad key': 1}: expected a mapping of template variable names to values, "
        "e.g. {enable_thinking: false}"
    ]
    builtin = "\n".join(DataConfig(chat_template_kwargs=kw).problems(8, MAX_LEN))
    assert (
        "data.chat_template_kwargs={'enable_thinking': False}: expected {} with the built-in task" in builtin
    )
