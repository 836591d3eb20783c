"""The critic service's rewards in-process (no Triton): reward models (ours, HF sequence
classifiers, ones reading text with their own tokenizer), reward functions' conventions and
arguments, merged requests whose bad samples fail only their own request, and the
reward_only mode."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from _critic_service import _batch, _service, assert_values_of_real_positions

from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import tiny_config
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.forward import sequence_scores, token_values
from aligner.models.gpt import build_reward_model
from aligner.tasks.digits import sort_reward
from aligner.wire import protocol as P


def test_reward_model_scores_are_added_and_critic_starts_from_it(pstate, tmp_path):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=32)
    rm = build_reward_model(cfg)
    save_model_checkpoint(rm, cfg, tmp_path / "rm", role="reward")
    svc = _service(  # fp32: compared exactly with the fp32 reward model below
        pstate,
        tmp_path,
        precision="fp32",
        reward={"model_path": str(tmp_path / "rm"), "model_mean": 0.5, "model_std": 2.0},
    )
    assert svc.init_source == "reward" and svc.info().reward["model_path"] == str(tmp_path / "rm")
    tokens, lengths, pl, *_, prompts, responses = _batch(svc)
    out = svc.infer(tokens, lengths, pl)
    t = torch.from_numpy(tokens)
    scores = sequence_scores(rm, t, torch.from_numpy(lengths)).detach().numpy()
    expected = np.asarray(sort_reward(prompts, responses)) + (scores - 0.5) / 2.0
    np.testing.assert_allclose(out.rewards, expected, rtol=1e-6, atol=1e-6)
    # The critic is the reward model's weights: its value at length-1 is the raw score (the
    # server's fused forward against Megatron's here: equal to round-off).
    values = token_values(rm, t).detach().numpy()
    assert_values_of_real_positions(out.values, values, lengths, atol=1e-5)


def test_hf_sequence_classification_reward_model(pstate, tmp_path):
    """reward.hf_path: a HF reward model scores like HF itself (read at the last real token)."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=14,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        num_labels=1,
        pad_token_id=13,
    )
    hf = transformers.LlamaForSequenceClassification(hf_cfg)
    hf.save_pretrained(tmp_path / "hf")
    svc = _service(pstate, tmp_path, precision="fp32", reward={"hf_path": str(tmp_path / "hf"), "fn": None})
    assert svc.init_source == "reward" and svc.model_cfg.ffn_hidden_size == 88
    tokens, lengths, pl, *_ = _batch(svc, b=3)
    assert svc.tokenizer.pad_id == hf_cfg.pad_token_id  # HF finds the last token by the pad id
    out = svc.infer(tokens, lengths, pl)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens)).logits[:, 0].numpy()
    np.testing.assert_allclose(out.rewards, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# One request's bad samples fail that request alone
# ------------------------------------------------------------------------------------------------


def test_one_requests_bad_samples_fail_only_that_request(pstate, tmp_path):
    """Merged requests (as Triton's batcher merges them) whose reward function fails on one
    request's samples: that request gets an error naming the function and the sample, the others
    what they would get alone. Through the server's callable, the failing request's response is
    its error output; alone, it is an error."""
    from aligner.critic.reward_fn import RewardFunctionError
    from aligner.critic.server import CriticTritonServer
    from aligner.critic.testing import encode_samples

    fn = "aligner.critic.testing:picky_reward"
    svc = _service(pstate, tmp_path, precision="fp32", reward={"fn": fn})
    good = [(["12:", "3:"], ["12", "3"]), (["45:", "789:"], ["45", "798"])]
    bad = {  # what goes wrong -> (prompts, responses), the failing sample, the words
        "raises": ((["1:", "2", "3:"], ["1", "2", "3"]), 1, "ValueError: prompt '2' has no ':'"),
        "nan": ((["1:", "2:"], ["1", ","]), 1, "its score is nan"),
        "inf": ((["1:"], [",,"]), 0, "its score is inf"),
        "count": ((["12:", "1:", "2:"], ["12", ",,,", "2"]), 1, "it returned 2 scores for 3 samples"),
    }

    def request(prompts, responses):
        return P.InferRequest(*encode_samples(svc.tokenizer, prompts, responses, pad_to=8))

    alone = [svc.infer(*request(*g).to_wire().values()) for g in good]
    for what, (samples, sample, words) in bad.items():
        reqs = [request(*good[0]), request(*samples), request(*good[1])]
        out = svc.infer_many(reqs)
        err = out[1]
        assert isinstance(err, RewardFunctionError), what
        assert str(err) == f"reward function {fn!r} failed on sample {sample} of the request: " + err.detail
        assert words in str(err), (what, str(err))
        for got, want in zip((out[0], out[2]), alone):
            np.testing.assert_array_equal(got.values, want.values)
            np.testing.assert_array_equal(got.rewards, want.rewards)
        with pytest.raises(RewardFunctionError, match=f"failed on sample {sample} of the request"):
            svc.infer(*reqs[1].to_wire().values())
        # The server's callable, as PyTriton calls it with a merged execution.
        server = CriticTritonServer(svc, svc.cfg, tmp_path)
        wire = server.infer_fn([r.to_wire() for r in reqs])
        assert set(wire[1]) == {"error"} and wire[1]["error"].shape == (len(samples[0]), 1)
        assert {e.decode() for e in wire[1]["error"].ravel()} == {str(err)}
        for got, want in zip((wire[0], wire[2]), alone):
            np.testing.assert_array_equal(got["values"], want.values)
            assert set(got["error"].ravel()) == {b""}
        with pytest.raises(RewardFunctionError):
            server.infer_fn([reqs[1].to_wire()])  # alone in its execution: its own error


# ------------------------------------------------------------------------------------------------
# Reward functions: two conventions, keyword arguments, extra columns
# ------------------------------------------------------------------------------------------------


def test_reward_fn_conventions_and_keyword_arguments():
    from aligner.critic.reward_fn import RewardArgumentError, RewardFn

    seen = {}

    def ours(prompts, responses):
        seen["ours"] = (prompts, responses)
        return [0.0] * len(prompts)

    def ours_kw(prompts, responses, prompt_ids=None, **kwargs):
        seen["ours_kw"] = (prompt_ids, kwargs)
        return [0.0] * len(prompts)

    def trlx(samples, prompts, outputs, **kwargs):
        seen["trlx"] = (samples, prompts, outputs, kwargs)
        return [0.0] * len(samples)

    def trlx_short(samples, **kwargs):
        seen["trlx_short"] = (samples, kwargs)
        return [0.0] * len(samples)

    def needs(prompts, responses, answer, scale=1.0):
        seen["needs"] = (answer, scale)
        return [0.0] * len(prompts)

    batch = (["1:", "2:"], ["1", "22"], [[2, 11], [3, 11]], [[2], [3, 3]])
    extras = [{"answer": "1", "prompts": "not passed"}, {"answer": "22", "level": 3}]
    RewardFn(ours, "m:ours")(*batch, extras)
    assert seen["ours"] == (["1:", "2:"], ["1", "22"])  # no keyword it does not take
    RewardFn(ours_kw, "m:ours_kw", {"clf": "/m"})(*batch, extras)
    assert seen["ours_kw"] == (
        [[2, 11], [3, 11]],
        {"response_ids": [[2], [3, 3]], "clf": "/m", "answer": ["1", "22"], "level": [None, 3]},
    )
    fn = RewardFn(trlx, "m:trlx")
    assert fn.convention == "trlx"
    fn(*batch, extras)
    assert seen["trlx"][:3] == (["1:1", "2:22"], ["1:", "2:"], ["1", "22"])
    assert sorted(seen["trlx"][3]) == ["answer", "level", "prompt_ids", "response_ids"]
    RewardFn(trlx_short, "m:trlx_short")(*batch, None)
    assert seen["trlx_short"][0] == ["1:1", "2:22"]
    assert sorted(seen["trlx_short"][1]) == ["outputs", "prompt_ids", "prompts", "response_ids"]
    fn = RewardFn(needs, "m:needs", {"scale": 2.0})
    assert fn.required_columns == ["answer"]
    fn(*batch, extras)
    assert seen["needs"] == (["1", "22"], 2.0)
    with pytest.raises(RewardArgumentError) as e:
        fn(*batch, [{"other": 1}, {}])
    assert "required parameter 'answer'" in str(e.value) and "columns: ['other']" in str(e.value)
    # Refused when loaded: a signature that cannot take a batch; a fn_kwargs key it does not take.
    for bad, words in (
        (lambda texts: texts, "signature <lambda>(texts) cannot take a batch"),
        (lambda prompts, responses, extra, /: [], "positional-only parameter 'extra' cannot be given"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)) as e:
            RewardFn(bad, "m:bad")
        assert "fn(samples, prompts, outputs, **kwargs)" in str(e.value)
    with pytest.raises(ValueError, match="fn_kwargs key 'answer' is not a parameter"):
        RewardFn(ours, "m:ours", {"answer": 1})
    with pytest.raises(ValueError, match="gets 'prompt_ids' from the batch"):
        RewardFn(ours_kw, "m:ours_kw", {"prompt_ids": 1})


def test_merged_requests_score_as_alone_whatever_columns_they_carry():
    """Requests with the same columns share one call; with other columns, or one that cannot
    fill a required parameter, each is scored alone (and that one fails alone)."""
    from aligner.critic.reward_fn import RewardArgumentError, score_requests
    from aligner.critic.testing import encode_samples
    from aligner.tokenizers import build_tokenizer

    tok = build_tokenizer("char")
    calls = []

    def fn(prompts, responses, answer, bonus=0.0):
        calls.append(len(prompts))
        return [
            float(r == a) + (b or 0.0)
            for r, a, b in zip(responses, answer, np.broadcast_to(bonus, len(answer)))
        ]

    def req(responses, extras):
        return (*encode_samples(tok, ["1:"] * len(responses), responses, pad_to=6), extras)

    a = req(["1", "2"], [{"answer": "1"}, {"answer": "1"}])
    b = req(["3"], [{"answer": "3"}])
    c = req(["4"], [{"answer": "4", "bonus": 0.5}])
    d = req(["5"], None)
    out = score_requests(fn, "m:fn", tok, [a, b])
    assert calls == [3] and [list(x) for x in out] == [[1.0, 0.0], [1.0]]
    calls.clear()
    out = score_requests(fn, "m:fn", tok, [a, c, d])
    assert calls == [2, 1] and [list(x) for x in out[:2]] == [[1.0, 0.0], [1.5]]
    assert isinstance(out[2], RewardArgumentError) and "columns: none" in str(out[2])


def test_a_reward_model_with_its_own_tokenizer_reads_the_texts(pstate, tmp_path, monkeypatch):
    """reward.tokenizer other than the policy's: the reward model scores prompt + response text
    tokenized its way (cut from the left to its max_seq_len); the critic keeps the policy's ids.
    Through the server's callable, requests with and without the optional inputs merge safely."""
    from aligner.actor.critic_link import sample_texts
    from aligner.critic.server import CriticTritonServer
    from aligner.critic.testing import encode_samples
    from aligner.tokenizers import build_tokenizer

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "h3_bonus_reward.py").write_text(
        "from aligner.tasks.digits import sort_reward\n"
        "def score(prompts, responses, bonus=None, **_):\n"
        "    bonus = bonus or [None] * len(prompts)\n"
        "    return [s + (b or 0.0) for s, b in zip(sort_reward(prompts, responses), bonus)]\n"
    )
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    rm_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=8)
    rm = build_reward_model(rm_cfg)
    save_model_checkpoint(rm, rm_cfg, tmp_path / "rm", role="reward")
    reward_spec = "char:9876543210:,"  # the reward model's ids: another alphabet than the policy's
    svc = _service(
        pstate,
        tmp_path,
        precision="fp32",
        reward={
            "fn": "h3_bonus_reward:score",
            "python_path": [str(mods)],
            "model_path": str(tmp_path / "rm"),
            "tokenizer": reward_spec,
            "model_mean": 0.5,
            "model_std": 2.0,
        },
        init={"source": "fresh"},
    )
    assert svc.infer_inputs == ["extras", "prompt_text", "response_text"] == svc.info().infer_inputs
    assert svc.limits.max_seq_len == 32  # the critic's: the reward model cuts its own sequences
    policy, reward_tok = svc.tokenizer, build_tokenizer(reward_spec)
    prompts, responses = ["314:", "90:", "123456:"], ["134", "09", "123456"]  # the last: 13 > 8 chars
    tokens, lengths, pl = encode_samples(policy, prompts, responses, pad_to=16)
    assert sample_texts(policy, tokens, lengths, pl) == (prompts, responses)
    texts = {"prompt_texts": prompts, "response_texts": responses}
    out = svc.infer(tokens, lengths, pl, **texts, extras=['{"bonus":1.5}', "{}", "{}"])
    scores = []
    for p, r in zip(prompts, responses):
        ids = reward_tok.encode(p + r)[-8:]
        with torch.no_grad():
            scores.append(float(sequence_scores(rm, torch.tensor([ids]), torch.tensor([len(ids)]))[0]))
    want = np.asarray(sort_reward(prompts, responses)) + [1.5, 0, 0] + (np.asarray(scores) - 0.5) / 2.0
    np.testing.assert_allclose(out.rewards, want, rtol=0, atol=1e-5)
    assert_values_of_real_positions(
        out.values, token_values(svc.critic, torch.from_numpy(tokens)).detach().numpy(), lengths, atol=1e-5
    )
    text = svc.info().reward["text"]
    assert (text["tokenizer"], text["rows"], text["truncated"]) == (reward_spec, 3, 1)
    with pytest.raises(P.ProtocolError, match="field 'prompt_text'.*reads text with its own tokenizer"):
        svc.infer(tokens, lengths, pl)

    # Merged by Triton's batcher: each request is read with its own optional inputs.
    def wire(rows, **optional):
        req = P.InferRequest(tokens[rows], lengths[rows], pl[rows])
        for name, values in optional.items():
            setattr(req, name, [values[i] for i in rows])
        return req.to_wire()

    full = wire([0, 1], prompt_texts=prompts, response_texts=responses, extras=['{"bonus":1.5}', "{}"])
    no_extras = wire([2], prompt_texts=prompts, response_texts=responses)
    no_texts = wire([1], extras=["{}", "{}", "{}"])
    server = CriticTritonServer(svc, svc.cfg, tmp_path)
    alone = [server.infer_fn([w])[0] for w in (full, no_extras)]
    merged = server.infer_fn([full, no_extras])
    for got, want_wire in zip(merged, alone):
        np.testing.assert_allclose(got["rewards"], want_wire["rewards"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["values"], want_wire["values"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(merged[0]["rewards"].ravel(), want[:2], rtol=0, atol=1e-5)
    np.testing.assert_allclose(merged[1]["rewards"].ravel(), want[2:], rtol=0, atol=1e-5)
    with pytest.raises(P.ProtocolError) as e:
        server.infer_fn([full, no_texts])  # the valid one retries (batch peer)
    assert "field 'prompt_text'" in str(e.value) and P.BATCH_PEER_MARK in str(e.value)
    with pytest.raises(P.ProtocolError, match="field 'prompt_text'"):
        server.infer_fn([no_texts])


def test_a_reward_model_reading_text_never_seeds_the_critic(pstate, tmp_path):
    """The critic reads the policy's ids: a reward model with its own tokenizer cannot be its
    starting point. 'auto' starts the critic fresh (or from init.policy_path); 'reward' is refused."""
    from aligner.critic.errors import CriticServiceError

    rm_cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=8)
    save_model_checkpoint(build_reward_model(rm_cfg), rm_cfg, tmp_path / "rm", role="reward")
    reward = {"model_path": str(tmp_path / "rm"), "tokenizer": "char:9876543210:,"}
    svc = _service(pstate, tmp_path / "auto", precision="fp32", reward=reward)
    assert svc.init_source == "fresh" and "prompt_text" in svc.infer_inputs
    with pytest.raises(CriticServiceError, match="init.source='reward': the reward model reads text"):
        _service(pstate, tmp_path / "reward", precision="fp32", reward=reward, init={"source": "reward"})


def test_reward_tokens_chat_template_special_tokens_and_left_truncation(tmp_path):
    """The reward model's ids: prompt + response with the tokenizer's special tokens (a BOS here),
    or the chat template's text of a user and an assistant turn; cut from the left past max_len;
    a sample that makes no token is refused naming it."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers

    from aligner.critic.reward_model import RewardTextError, RewardTokens
    from aligner.tokenizers import build_tokenizer

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.train_from_iterator(
        ["0123456789:, UA|"], trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'][0] | upper }}|{{ m['content'] }}{% endfor %}"
    )
    fast.save_pretrained(tmp_path / "tok")
    hf = build_tokenizer(str(tmp_path / "tok"))
    ids = {c: fast.convert_tokens_to_ids(c) for c in "<s> 1 2 : 3 U A |".split()}

    plain = RewardTokens(hf, "tok", max_len=5)
    tokens, lengths = plain.encode(["1:", "12:"], ["2", "3"])
    assert tokens.tolist() == [
        [ids["<s>"], ids["1"], ids[":"], ids["2"], 0],
        [ids["<s>"], ids["1"], ids["2"], ids[":"], ids["3"]],
    ]
    assert lengths.tolist() == [4, 5] and (plain.rows, plain.truncated) == (2, 0)
    tokens, lengths = plain.encode(["12:"], ["33"])  # 6 ids: the BOS is cut
    assert tokens.tolist() == [[ids["1"], ids["2"], ids[":"], ids["3"], ids["3"]]] and plain.truncated == 1

    chat = RewardTokens(hf, "tok", max_len=32, chat_template=True)
    tokens, lengths = chat.encode(["1:"], ["2"])
    want = [ids["<s>"], ids["U"], ids["|"], ids["1"], ids[":"], ids["A"], ids["|"], ids["2"]]
    assert tokens[0, : lengths[0]].tolist() == want
    with pytest.raises(
        ValueError, match="reward.chat_template=true, but the reward tokenizer 'char' has no chat"
    ):
        RewardTokens(build_tokenizer("char"), "char", max_len=8, chat_template=True)
    with pytest.raises(
        RewardTextError, match="tokenizer 'char' failed on sample 1 of the request: .*no token"
    ):
        RewardTokens(build_tokenizer("char"), "char", max_len=8).encode(["1:", ""], ["2", ""])


def test_a_reward_only_server_needs_no_model_section(pstate, tmp_path):
    """mode=reward_only builds no model: its unused model section neither refuses a larger
    tokenizer nor bounds the samples' length (a reward function takes any)."""
    from aligner.critic.build import REWARD_ONLY_MAX_SEQ_LEN

    cfg = tiny_config(tmp_path)
    cfg.update(mode="reward_only", tokenizer="char:0123456789:,abcdefghijklmnopqrstuvwxyz")
    svc = CriticService(build_config(cfg), pstate)
    assert svc.critic is None and svc.limits.max_seq_len == REWARD_ONLY_MAX_SEQ_LEN
    assert svc.limits.vocab_size == 40 > svc.cfg.model.vocab_size
    tokens, lengths, pl, *_, prompts, responses = _batch(svc)
    np.testing.assert_allclose(
        svc.infer(tokens, lengths, pl).rewards, sort_reward(prompts, responses), atol=1e-6
    )
