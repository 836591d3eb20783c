"""The examples' assets (examples/sentiment, examples/arithmetic): reward functions on hand-worked
cases, data builders, and the tiny model builders (their folders load in transformers and in this
project). Everything is built in tmp_path, without a download."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from _examples import load

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- arithmetic


@pytest.fixture(scope="module")
def arith_reward():
    return load("arithmetic", "reward")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7", 7),
        ("3 + 4 = 7.", 7),  # the last integer, not the first
        ("The answer is -12", -12),
        ("about 1,234 apples", 1234),
        ("12 then 1,2345", 2345),  # not a thousands group: two integers
        ("seven", None),
        ("", None),
        ("x3y", 3),
    ],
)
def test_last_integer(arith_reward, text, expected):
    assert arith_reward.last_integer(text) == expected


def test_arithmetic_reward_right_wrong_unparseable(arith_reward):
    outputs = ["81", "It is 80", "eighty-one", "23 + 58 = 81", "81 or maybe 80", "-5", "1,000"]
    answers = ["81", "81", "81", "81", "81", -5, 1000]
    samples = [f"What is 23 + 58?{o}" for o in outputs]
    got = arith_reward.reward_fn(samples, ["p"] * 7, outputs, answers)
    assert got == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    with_format = arith_reward.reward_fn(samples, ["p"] * 7, outputs, answers, format_reward=0.1)
    assert with_format == [1.0, 0.1, 0.0, 1.0, 0.1, 1.0, 1.0]
    assert arith_reward.reward_fn([], [], [], []) == []
    # Server keyword arguments it does not use are accepted and ignored.
    assert arith_reward.reward_fn(["7"], ["3+4="], ["7"], ["7"], prompt_ids=[[1]], response_ids=[[2]]) == [
        1.0
    ]


def test_arithmetic_reward_refusals(arith_reward):
    with pytest.raises(ValueError, match=r"answer has 1 values for 2 outputs"):
        arith_reward.reward_fn(["a", "b"], ["a", "b"], ["1", "2"], ["1"])
    with pytest.raises(ValueError, match=r"answer\[1\]='n/a': expected an integer"):
        arith_reward.reward_fn(["a", "b"], ["a", "b"], ["1", "2"], ["1", "n/a"])


def test_arithmetic_data(tmp_path):
    make_data = load("arithmetic", "make_data")
    paths = make_data.write_data(str(tmp_path / "d"), num_train=50, num_test=10, digits=2, ops="+-*", seed=3)
    rows = {split: [json.loads(line) for line in open(p)] for split, p in paths.items()}
    assert len(rows["train"]) == 50 and len(rows["test"]) == 10
    prompts = [r["prompt"] for r in rows["train"] + rows["test"]]
    assert len(set(prompts)) == 60  # distinct, and train and test share none
    for r in rows["train"] + rows["test"]:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split(" ")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert r["answer"] == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
    again = make_data.write_data(str(tmp_path / "e"), num_train=50, num_test=10, digits=2, ops="+-*", seed=3)
    assert Path(again["train"]).read_text() == Path(paths["train"]).read_text()  # seeded

    compact = make_data.make_problems(100, digits=1, ops="+", style="compact")
    assert sorted(r["prompt"] for r in compact) == sorted(f"{a}+{b}=" for a in range(10) for b in range(10))
    assert {"prompt": "3+4=", "answer": "7"} in compact
    small = make_data.make_problems(9, max_operand=2, ops="+", style="compact")
    assert sorted(r["prompt"] for r in small) == sorted(f"{a}+{b}=" for a in range(3) for b in range(3))
    with pytest.raises(ValueError, match=r"n=10: expected 0 to 9 \(the distinct problems of operands 0-2"):
        make_data.make_problems(10, max_operand=2)
    with pytest.raises(ValueError, match=r"n=101: expected 0 to 100"):
        make_data.make_problems(101, digits=1, ops="+")
    with pytest.raises(ValueError, match=r"ops='/'"):
        make_data.make_problems(1, ops="/")
    with pytest.raises(ValueError, match=r"style='essay'"):
        make_data.make_problems(1, style="essay")


def test_arithmetic_tiny_policy_and_chat_template(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aligner.models.hf_config import model_config_from_hf
    from aligner.tokenizers import build_tokenizer

    make_tiny = load("arithmetic", "make_tiny")
    built = make_tiny.build(str(tmp_path / "tiny"))
    policy = built["policy"]

    tok = build_tokenizer(policy)  # the actor's and the server's tokenizer
    assert tok.has_chat_template()
    text = tok.apply_chat_template([{"role": "user", "content": "3+4="}])
    assert text == "<|user|>3+4=<|end|><|assistant|>"
    ids = tok.encode(text)
    assert len(ids) == 7  # one token per character, one per special token
    assert tok.decode(tok.encode("7<|end|>")) == "7"
    assert tok.decode(tok.encode("12 + 3")) == "12 + 3"  # spaces survive (character level)
    assert tok.eos_id == tok.hf.convert_tokens_to_ids("<|end|>")
    system = tok.apply_chat_template([{"role": "system", "content": "1"}, {"role": "user", "content": "2"}])
    assert system == "<|system|>1<|end|><|user|>2<|end|><|assistant|>"

    cfg = model_config_from_hf(policy)  # what init_from builds the Megatron policy from
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, tok.vocab_size)
    assert cfg.num_query_groups == 2 and cfg.tie_embeddings

    hf_tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 7, len(hf_tok)) and torch.isfinite(logits).all()

    train = [json.loads(line) for line in open(os.path.join(built["data"], "train.jsonl"))]
    test = [json.loads(line) for line in open(os.path.join(built["data"], "test.jsonl"))]
    sums = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    assert sorted(test, key=str) == sorted(sums, key=str)  # the 25 sums of 0-4, once
    assert len(train) == 200 and all(train.count(r) == 8 for r in sums)
    assert all(len(tok.encode(r["prompt"])) == 4 for r in train)


# ---------------------------------------------------------------- sentiment


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory):
    """The tiny sentiment setup, built once (a few seconds: the classifier is fine-tuned)."""
    make_tiny = load("sentiment", "make_tiny")
    out = tmp_path_factory.mktemp("sentiment")
    built = make_tiny.build(str(out))
    return make_tiny, built


def test_sentiment_reward_orders_texts_as_trained(sentiment):
    _, built = sentiment
    reward = load("sentiment", "reward")
    prompts = ["This movie was", "The plot seemed", "The acting was", "The film felt"]
    outputs = [" great and wonderful", " terrible and boring", " the story of the night", " qzx vvb"]
    samples = [p + o for p, o in zip(prompts, outputs)]
    probs = reward.positive_score(samples, prompts, outputs, classifier=built["classifier"])
    assert len(probs) == 4 and all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in probs)
    assert probs[0] > 0.9 and probs[1] < 0.1, probs
    assert probs[1] < probs[2] < probs[0] and probs[1] < probs[3] < probs[0], probs

    logits = reward.positive_score(samples, prompts, outputs, classifier=built["classifier"], output="logit")
    assert len(logits) == 4 and all(math.isfinite(x) for x in logits)
    assert logits[0] > 0 > logits[1]
    # Batched in pieces, the same scores.
    small = reward.positive_score(samples, prompts, outputs, classifier=built["classifier"], batch_size=3)
    assert small == pytest.approx(probs, abs=1e-5)
    # The response alone, and the server's extra keyword arguments ignored.
    alone = reward.positive_score(
        samples, prompts, outputs, classifier=built["classifier"], score="outputs", prompt_ids=[[0]] * 4
    )
    assert alone[0] > 0.9 and alone[1] < 0.1
    assert reward.positive_score([], [], [], classifier=built["classifier"]) == []
    # The pipeline is loaded once per folder.
    assert reward.load_classifier.cache_info().currsize == 1


def test_sentiment_reward_refusals():
    reward = load("sentiment", "reward")
    with pytest.raises(ValueError, match=r"output='score': expected one of \['prob', 'logit'\]"):
        reward.classify(["x"], "unused", output="score")
    with pytest.raises(ValueError, match=r"score='both'"):
        reward.positive_score(["x"], ["x"], [""], classifier="unused", score="both")
    assert reward.positive_label({0: "NEGATIVE", 1: "POSITIVE"}) == "POSITIVE"
    assert reward.positive_label({0: "LABEL_0", 1: "LABEL_1"}) == "LABEL_1"
    assert reward.positive_label({0: "neg", 1: "pos", 2: "neutral"}) == "pos"
    with pytest.raises(ValueError, match=r"positive_label='good': expected one of"):
        reward.positive_label({0: "NEGATIVE", 1: "POSITIVE"}, "good")
    with pytest.raises(ValueError, match=r"cannot tell the positive label"):
        reward.positive_label({0: "a", 1: "b", 2: "c"})


def test_sentiment_builders_load(sentiment):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from aligner.models.hf_config import model_config_from_hf
    from aligner.tokenizers import build_tokenizer

    _, built = sentiment
    assert built["classifier_stats"]["accuracy"] >= 0.9, built["classifier_stats"]

    tok = build_tokenizer(built["policy"])
    cfg = model_config_from_hf(built["policy"])
    assert cfg.vocab_size == tok.vocab_size == 768 and cfg.max_seq_len == 64
    assert tok.decode(tok.encode("This movie was great")) == "This movie was great"
    # Every sentiment word is one token of the policy: one choice for PPO to learn.
    make_tiny = sentiment[0]
    for word in make_tiny.POSITIVE + make_tiny.NEGATIVE:
        assert len(tok.encode(" " + word)) == 1, word

    clf_tok = AutoTokenizer.from_pretrained(built["classifier"])
    # Its vocabulary is written, not trained: the same in every process (the WordPiece trainer's was
    # not, and some of its draws left the classifier predicting a constant).
    assert clf_tok.get_vocab() == make_tiny.classifier_tokenizer(make_tiny.corpus(0)).get_vocab()
    for word in make_tiny.POSITIVE + make_tiny.NEGATIVE:
        assert clf_tok.tokenize(word) == [word], word
    clf = AutoModelForSequenceClassification.from_pretrained(built["classifier"]).eval()
    assert clf.config.id2label == {0: "NEGATIVE", 1: "POSITIVE"}
    enc = clf_tok(["a wonderful film", "a dull film"], padding=True, return_tensors="pt")
    assert "token_type_ids" not in enc
    with torch.no_grad():
        p = clf(**enc).logits.softmax(-1)[:, 1]
    assert p[0] > 0.5 > p[1]

    prompts = [json.loads(line)["prompt"] for line in open(built["prompts"])]
    assert len(prompts) == 256 == len(set(prompts))
    assert max(len(tok.encode(p)) for p in prompts) <= 16  # short, leaving the context to responses


def test_a_policy_that_prefers_positive_words_scores_higher(sentiment):
    make_tiny, built = sentiment
    m = make_tiny.measure(os.path.dirname(built["policy"]), n=12, new_tokens=6)
    assert m["positive_tokens"] == len(make_tiny.POSITIVE) and m["negative_tokens"] == len(make_tiny.NEGATIVE)
    assert m["positive_bias"] > m["random_policy"] + 0.25 > m["negative_bias"] + 0.5, m


def test_prepare_imdb_from_a_local_file(sentiment, tmp_path):
    prepare = load("sentiment", "prepare_imdb")
    reviews = [
        {"text": "I loved this film.<br /><br />The cast was superb and the music too.", "label": 1},
        {"text": "  Dull   from start to end, with a <i>weak</i> script.", "label": 0},
        {"text": "Short.", "label": 1},
    ]
    src = tmp_path / "reviews.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reviews))
    assert prepare.review_opening(reviews[0]["text"], 4) == "I loved this film."
    assert prepare.review_opening(reviews[1]["text"], 5) == "Dull from start to end,"

    out = tmp_path / "prompts.jsonl"
    n = prepare.prepare(str(out), dataset=str(src), min_tokens=3, max_tokens=3, with_label=True)
    rows = [json.loads(line) for line in open(out)]
    assert n == 3 and rows == [
        {"prompt": "I loved this", "label": 1},
        {"prompt": "Dull from start", "label": 0},
        {"prompt": "Short.", "label": 1},
    ]
    # Lengths in the policy's tokens: each prompt is the start of its cleaned review.
    _, built = sentiment
    n = prepare.prepare(str(out), dataset=str(src), min_tokens=2, max_tokens=4, tokenizer=built["policy"])
    rows = [json.loads(line) for line in open(out)]
    assert n == 3 and all(set(r) == {"prompt"} for r in rows)
    for r, review in zip(rows, reviews):
        assert prepare.clean(review["text"]).startswith(r["prompt"]) and r["prompt"]
    with pytest.raises(ValueError, match=r"has no column 'text'"):
        prepare.load_reviews(str(out), "train")


# ---------------------------------------------------------------- as the server calls them


@pytest.fixture
def server_import(monkeypatch):
    """Load a reward function as the critic server does (``reward.python_path`` + ``reward.fn``),
    leaving sys.path and the examples' shared module name ``reward`` as they were."""
    from aligner.critic.reward_fn import load_reward_fn

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "reward", raising=False)

    def load_fn(example: str, fn: str, **fn_kwargs):
        sys.modules.pop("reward", None)
        return load_reward_fn(fn, fn_kwargs, python_path=[str(ROOT / "examples" / example)])

    yield load_fn
    sys.modules.pop("reward", None)


def test_the_server_calls_them_in_trlx_convention(server_import, sentiment):
    arith = server_import("arithmetic", "reward:reward_fn", format_reward=0.1)
    assert arith.convention == "trlx"
    got = arith(
        ["3+4=", "2+2=", "1+1="],
        ["7", "5", "two"],
        [[1], [2], [3]],
        [[4], [5], [6]],
        [{"answer": "7"}, {"answer": "4"}, {"answer": "2"}],
    )
    assert list(got) == [1.0, 0.1, 0.0]

    _, built = sentiment
    sent = server_import("sentiment", "reward:positive_score", classifier=built["classifier"])
    assert sent.convention == "trlx"
    got = sent(["This movie was"] * 2, [" wonderful", " awful"], [[1]] * 2, [[2]] * 2, None)
    assert len(got) == 2 and got[0] > 0.9 > 0.1 > got[1]


# ---------------------------------------------------------------- the READMEs' commands


def readme_commands(example: str) -> list[tuple[str, list[str]]]:
    """``(entry point, Hydra overrides)`` of each server or actor command in the example's README."""
    import re
    import shlex

    text = (ROOT / "examples" / example / "README.md").read_text()
    out = []
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            for entry in ("servers/serve_critic.py", "examples/train_actor.py"):
                if entry in words:
                    out.append((entry, [w for w in words[words.index(entry) + 1 :] if "=" in w]))
    return out


@pytest.mark.parametrize("example", ["sentiment", "arithmetic"])
def test_readme_commands_use_real_config_keys(example):
    """Every override of the READMEs' server and actor commands composes against the configs, as
    Hydra composes them when the command runs (an unknown key or a wrong type fails here)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import aligner.actor.run  # noqa: F401  (registers the actor's config schema)
    import aligner.critic.server  # noqa: F401  (registers the server's config schema)

    commands = readme_commands(example)
    assert sorted({entry for entry, _ in commands}) == ["examples/train_actor.py", "servers/serve_critic.py"]
    for entry, overrides in commands:
        name = "critic" if entry.startswith("servers") else "actor"
        with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
            cfg = OmegaConf.to_object(compose(name, overrides=overrides))
        if name == "critic":
            assert cfg.reward.fn.startswith("reward:") and cfg.reward.fn_kwargs
        else:
            assert cfg.init_from and cfg.data.dataset
