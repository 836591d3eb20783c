"""Reward functions and reward models that read text, end to end: one real PyTriton server for the
module, talked to through bare tritonclients (aligner.critic.testing's raw_* helpers) and the
client.

The server has both reward sources, each needing an optional critic_infer input:

- a trlx-style reward function ``score(samples, prompts, outputs, answer, bonus=0.0, **kwargs)``
  in a module written here, outside the repository, found through ``reward.python_path``; it
  reads the extras column ``answer`` and the constant ``reward.fn_kwargs`` ``bonus``;
- a Hugging Face Llama sequence classifier whose folder holds a tokenizer trained here (one token
  per character, a BOS added), not the policy's ``char`` tokenizer: the server tokenizes the
  texts the request carries with it, cut from the left to the reward model's 16 positions.

Every score is recomputed here: the function's by hand, the reward model's by transformers on the
same text tokenized by its own tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _critic_service import concurrently

from aligner.actor.critic_link import sample_texts
from aligner.critic.launch import start_server
from aligner.critic.testing import encode_samples, raw_error, raw_infer, raw_info, tiny_overrides
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.client import RemoteCriticClient

pytestmark = pytest.mark.server

TOK = build_tokenizer("char")  # the policy's
RM_MAX_LEN = 16
MEAN, STD, BONUS = 0.5, 2.0, 0.25
MODULE = "h3_answer_reward"

REWARD_MODULE = '''
def score(samples, prompts, outputs, answer, bonus=0.0, **kwargs):
    """trlx's convention: 1 for the answer, plus a bonus and a thousandth per sample character."""
    for s, p, o in zip(samples, prompts, outputs):
        if s != p + o:
            raise ValueError(f"sample {s!r} is not prompt {p!r} + output {o!r}")
    return [float(o == a) + bonus + 0.001 * len(s) for s, o, a in zip(samples, outputs, answer)]
'''


def _reward_tokenizer(folder):
    """A tokenizer of one token per character with a BOS, trained here, saved as a HF folder."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(["0123456789:, the answer"], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    transformers = pytest.importorskip("transformers")  # here: collecting the module stays light
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("reward_inputs")
    (root / "mods").mkdir()
    (root / "mods" / f"{MODULE}.py").write_text(REWARD_MODULE)
    torch.manual_seed(3)
    hf_tok = _reward_tokenizer(root / "rm")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=RM_MAX_LEN,
        num_labels=1,
        pad_token_id=hf_tok.pad_token_id,
    )
    rm = transformers.LlamaForSequenceClassification(hf_cfg).eval()
    rm.save_pretrained(root / "rm")
    server = start_server(
        tiny_overrides(
            root,
            **{
                "reward.fn": f"{MODULE}:score",
                "reward.python_path": f"['{root / 'mods'}']",
                "+reward.fn_kwargs.bonus": BONUS,  # (Hydra adds a key to a dict with +)
                "reward.hf_path": root / "rm",  # its tokenizer files make it read text
                "reward.model_mean": MEAN,
                "reward.model_std": STD,
                "init.source": "fresh",
                "precision": "fp32",  # compared with transformers' fp32 forward
                "server.max_queue_delay_us": 5000,
            },
        ),
        log_path=root / "server.stderr",
    )
    try:
        yield {"server": server, "rm": rm, "hf_tok": hf_tok, "root": root}
    finally:
        server.stop()


def _samples(prompts, responses, answers, pad_to=None):
    """The policy's arrays, the texts the actor sends, and the extras: (wire inputs, texts)."""
    tokens, lengths, pl = encode_samples(TOK, prompts, responses, pad_to)
    prompt_texts, response_texts = sample_texts(TOK, tokens, lengths, pl)
    assert (prompt_texts, response_texts) == (list(prompts), list(responses))
    extras = [json.dumps({"answer": a, "source": "test"}, separators=(",", ":")) for a in answers]
    req = P.InferRequest(tokens, lengths, pl, prompt_texts, response_texts, extras)
    return req


def _expected(env, prompts, responses, answers) -> np.ndarray:
    """The function's score by hand, plus the standardised score transformers gives the text tokenized
    by the reward model's own tokenizer (BOS added; the first tokens cut beyond 16)."""
    fn = [float(r == a) + BONUS + 0.001 * len(p + r) for p, r, a in zip(prompts, responses, answers)]
    rm = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = env["hf_tok"](p + r, add_special_tokens=True)["input_ids"][-RM_MAX_LEN:]
            rm.append(float(env["rm"](torch.tensor([ids])).logits[0, 0]))
    return np.asarray(fn) + (np.asarray(rm) - MEAN) / STD


def _together(url, inputs: list[dict]) -> list:
    """One raw critic_infer per item of ``inputs``, each from its own thread, released at once;
    what each got: its outputs, or its error."""
    return concurrently([lambda x=x: raw_infer(url, P.INFER, x) for x in inputs])


PROMPTS = ["3142:", "907:", "555:", "123456789012:"]
RESPONSES = ["1234", "079", "55", "012345678912"]  # the last: 26 reward tokens, cut to 16
ANSWERS = ["1234", "079", "555", "011223345678"]


def test_server_info_names_the_inputs_it_needs(env):
    info = raw_info(env["server"].url)
    assert info.protocol_version == P.PROTOCOL_VERSION == 6
    assert info.infer_inputs == ["extras", "prompt_text", "response_text"]
    text = info.reward["text"]
    assert text["tokenizer"] == str(env["root"] / "rm") and text["max_len"] == RM_MAX_LEN
    assert info.reward["fn_convention"] == "trlx" and info.reward["fn_kwargs"] == ["bonus"]
    # The critic keeps the policy's ids: its length limit is the critic's, not the reward model's.
    assert info.max_seq_len == 32 and info.tokenizer_fingerprint == TOK.fingerprint()


def test_scores_are_the_function_plus_the_reward_model_on_its_own_tokens(env):
    url = env["server"].url
    before = raw_info(url).reward["text"]
    req = _samples(PROMPTS, RESPONSES, ANSWERS)
    out = raw_infer(url, P.INFER, req.to_wire())
    assert set(out["error"].ravel()) == {b""}
    want = _expected(env, PROMPTS, RESPONSES, ANSWERS)
    np.testing.assert_allclose(out["rewards"].ravel(), want, rtol=0, atol=1e-4)
    after = raw_info(url).reward["text"]
    assert (after["rows"] - before["rows"], after["truncated"] - before["truncated"]) == (4, 1)
    # The client sends the same inputs (and splits them with the rows into requests of 3).
    with RemoteCriticClient(url, timeout_s=30) as client:
        client._info.max_batch_size = 3  # as a server with max_batch_size=3 advertises it
        _, rewards = client.infer(
            req.tokens,
            req.lengths,
            req.prompt_lengths,
            prompt_texts=req.prompt_texts,
            response_texts=req.response_texts,
            extras=req.extras,
        ).result()
    np.testing.assert_allclose(rewards, want, rtol=0, atol=1e-4)


def test_a_request_without_the_texts_is_refused_naming_the_input(env):
    url = env["server"].url
    wire = _samples(PROMPTS[:2], RESPONSES[:2], ANSWERS[:2]).to_wire()
    for left_out in ("prompt_text", "response_text"):
        text = raw_error(url, P.INFER, {k: v for k, v in wire.items() if k != left_out})
        assert f"field {left_out!r}" in text and "reads text with its own tokenizer" in text, text[-600:]
    req = _samples(PROMPTS[:2], RESPONSES[:2], ANSWERS[:2])
    with RemoteCriticClient(url, timeout_s=30) as client:
        with pytest.raises(ValueError, match=r"needs \['prompt_text', 'response_text'\].*reads text"):
            client.infer(req.tokens, req.lengths, req.prompt_lengths, extras=req.extras)


def test_bad_optional_inputs_are_refused_naming_the_input_and_row(env):
    url = env["server"].url
    wire = _samples(PROMPTS[:3], RESPONSES[:3], ANSWERS[:3]).to_wire()
    bad_json = wire["extras"].copy()
    bad_json[1, 0] = b'{"answer": "079"'
    a_list = wire["extras"].copy()
    a_list[2, 0] = b'["079"]'
    bad_utf8 = wire["response_text"].copy()
    bad_utf8[0, 0] = b"12\xff"
    cases = [
        ({"extras": bad_json}, "'extras'", "row 1: invalid JSON"),
        ({"extras": a_list}, "'extras'", "row 2: a JSON list"),
        # Triton itself refuses rows that do not match the other inputs', before any Python runs.
        ({"extras": wire["extras"][:2]}, "input '", "batch size does not match other inputs"),
        ({"response_text": bad_utf8}, "'response_text'", "valid UTF-8"),
    ]
    for change, field, words in cases:
        text = raw_error(url, P.INFER, {**wire, **change})
        assert field in text and words in text, (field, words, text[-600:])
    # Refused requests changed nothing: the good one still scores as computed here.
    out = raw_infer(url, P.INFER, wire)
    want = _expected(env, PROMPTS[:3], RESPONSES[:3], ANSWERS[:3])
    np.testing.assert_allclose(out["rewards"].ravel(), want, rtol=0, atol=1e-4)


def test_a_request_without_the_column_fails_alone_when_merged(env):
    """The function needs the column ``answer``: a request whose extras lack it (or that carries
    none) gets an error naming the parameter and its columns; requests sent with it at the same
    time, merged by the batcher or not, get their scores."""
    url = env["server"].url
    good = [_samples([p], [r], [a], pad_to=30) for p, r, a in zip(PROMPTS, RESPONSES, ANSWERS)]
    wants = [_expected(env, [p], [r], [a]) for p, r, a in zip(PROMPTS, RESPONSES, ANSWERS)]
    other = good[0].to_wire() | {"extras": P.text_array(['{"other":1}'])}
    none = {k: v for k, v in good[1].to_wire().items() if k != "extras"}
    text = raw_error(url, P.INFER, other)
    assert "required parameter 'answer'" in text and "columns: ['other']" in text, text[-600:]
    for _ in range(3):  # released together, so that the batcher may merge them
        results = _together(url, [g.to_wire() for g in good] + [other, none])
        for got, want in zip(results[:4], wants):
            assert not isinstance(got, Exception), got
            np.testing.assert_allclose(got["rewards"].ravel(), want, rtol=0, atol=1e-4)
        for got, columns in zip(results[4:], ("['other']", "none")):
            text = str(got) if isinstance(got, Exception) else got["error"][0, 0].decode()
            assert "required parameter 'answer'" in text and f"columns: {columns}" in text, text[-600:]
