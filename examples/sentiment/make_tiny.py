"""The sentiment example in miniature, built here with no download: a tiny GPT-2 policy, a tiny
sentiment classifier and IMDB-style prompts.

    python examples/sentiment/make_tiny.py runs/sentiment_tiny          # builds, then measures
    python examples/sentiment/make_tiny.py runs/sentiment_tiny --no-measure

writes

    <out>/policy/       a random-init GPT2LMHeadModel (2 layers, width 64, context 64) with a
                        byte-level BPE tokenizer of 768 tokens trained on the built-in corpus
                        (every sentiment word is one token; "<|endoftext|>" ends a sequence)
    <out>/classifier/   a DistilBertForSequenceClassification (labels NEGATIVE, POSITIVE) with a
                        WordPiece tokenizer of the word lists' words, fine-tuned for a second or two on
                        sentences built from word lists: a sentiment word decides the label, text
                        without one (filler words, random letters) is taught to score 0.5
    <out>/prompts.jsonl 256 review openings ({"prompt": "This movie was"}), from word lists

The classifier is trained, not left at random init, so that the task is learnable: a response with
positive words scores near 1, one with negative words near 0, anything else near 0.5. A random
policy samples mostly word pieces and scores about 0.5; :func:`measure` shows that a policy that
prefers positive words (the same policy with a bias on those words' tokens) scores well above it,
which is what PPO has to find.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

POSITIVE = (
    "great wonderful amazing excellent beautiful brilliant fantastic good lovely superb enjoyable "
    "perfect fun touching best charming delightful moving"
).split()
NEGATIVE = (
    "terrible awful boring bad horrible dull poor weak worst stupid painful disappointing mediocre "
    "annoying ugly messy bland tedious"
).split()
NEUTRAL = (
    "the a and it was is this that movie film story plot acting actors scenes music ending cast "
    "director script with of in to then also some very really quite long short part first second "
    "time about characters camera screen night"
).split()
SUBJECTS = (
    "This movie",
    "The film",
    "The acting",
    "The plot",
    "The story",
    "The ending",
    "The soundtrack",
    "The cast",
    "This picture",
    "The script",
    "The director's work",
    "The second half",
    "The first scene",
    "The dialogue",
)
VERBS = ("was", "is", "felt", "seemed", "looked", "sounded")
OPENINGS = (
    "I watched this film last night and it was",
    "Honestly, I thought the movie was",
    "After the first hour I felt it was",
    "My friends told me the story was",
    "I went in expecting nothing and it was",
    "From the opening scene it was clear this was",
    "I have seen many films and this one was",
    "The critics said it was",
)
ENDOFTEXT = "<|endoftext|>"
CONTEXT = 64


PREFIXES = ("", "Overall, ", "In the end, ", "Honestly, ", "To be fair, ")


def _openings() -> list[str]:
    """Every distinct review opening the word lists make (428), in a fixed order."""
    pool = []
    for pre in PREFIXES:
        for s in SUBJECTS:
            subject = s if not pre else s[0].lower() + s[1:]
            pool += [f"{pre}{subject} {v}" for v in VERBS]
    return pool + list(OPENINGS)


def review_openings(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct short review openings ("This movie was", "Overall, the plot seemed", ...), in
    a shuffled order fixed by ``seed``."""
    pool = _openings()
    if not 1 <= n <= len(pool):
        raise ValueError(f"n={n}: expected 1 to {len(pool)} review openings")
    random.Random(seed).shuffle(pool)
    return pool[:n]


def _letters(rng: random.Random, low: int, high: int) -> str:
    """``low`` to ``high`` random letters and spaces."""
    letters = "abcdefghijklmnopqrstuvwxyz  "
    return "".join(rng.choice(letters) for _ in range(rng.randint(low, high))).strip() or "x"


def labelled_sentences(n: int, seed: int) -> list[tuple[str, float]]:
    """``n`` (text, P(positive)) pairs: a review opening (or, a quarter of the time, none: a
    response alone), then filler words with sentiment words mixed in (label 1.0 or 0.0 by which
    kind is more frequent, 0.5 for a tie or none), or random letters (0.5)."""
    rng = random.Random(seed)
    openings = _openings()
    out = []
    for _ in range(n):
        opening = rng.choice(openings) if rng.random() < 0.75 else ""  # or a response alone
        kind = rng.random()
        if kind < 0.12:  # word pieces and letters, as a random policy writes them
            out.append((f"{opening} {_letters(rng, 3, 24)}".strip(), 0.5))
            continue
        # filler: words, and now and then letters as a random policy writes them (so that letters
        # alone never tell the classifier a text is neutral: only the absence of sentiment words does)
        words = [
            rng.choice(NEUTRAL) if rng.random() < 0.7 else _letters(rng, 2, 6)
            for _ in range(rng.randint(0, 5))
        ]
        pos = rng.randint(0, 2) if kind < 0.56 else 0
        neg = rng.randint(0, 2) if kind >= 0.44 else 0
        for w in [rng.choice(POSITIVE) for _ in range(pos)] + [rng.choice(NEGATIVE) for _ in range(neg)]:
            words.insert(rng.randint(0, len(words)), w)
        label = 1.0 if pos > neg else 0.0 if neg > pos else 0.5
        out.append((f"{opening} {' '.join(words)}".strip(), label))
    return out


def corpus(seed: int = 0) -> list[str]:
    """The text the tokenizers are trained on."""
    return _openings() + [t for t, _ in labelled_sentences(1500, seed + 1)]


def policy_tokenizer(texts: list[str], vocab_size: int = 768):
    """A byte-level BPE tokenizer (GPT-2's kind) trained on ``texts``, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        model_max_length=CONTEXT,
    )


def classifier_tokenizer(texts: list[str]):
    """A lower-casing WordPiece tokenizer (BERT's kind), ``[CLS] text [SEP]``, whose vocabulary is
    every word of the word lists whole, and every character of ``texts`` alone and as a word piece
    (random letters are spelt out). Written, not trained: the ``tokenizers`` WordPiece trainer breaks
    ties by hash order, a vocabulary of its own in every process, and 2 of 66 of those left the
    classifier predicting a constant."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre = pre_tokenizers.BertPreTokenizer()

    def words(text: str) -> list[str]:
        return [w for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(text))]

    listed = _openings() + list(NEUTRAL + POSITIVE + NEGATIVE)
    whole = sorted({w for t in listed for w in words(t) if len(w) > 1})
    chars = sorted({c for t in texts for w in words(t) for c in w})
    vocab = {t: i for i, t in enumerate(specials + chars + ["##" + c for c in chars] + whole)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=CONTEXT,
        model_input_names=["input_ids", "attention_mask"],  # DistilBERT takes no token_type_ids
    )


def build_policy(out: str, tokenizer, seed: int = 0) -> str:
    """A random-init tiny GPT-2 in ``out`` (with ``tokenizer``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_classifier(out: str, tokenizer, seed: int = 0, steps: int = 150) -> dict:
    """A tiny DistilBERT sentiment classifier in ``out``, fine-tuned on :func:`labelled_sentences`
    (soft labels); returns its accuracy on held-out sentences with a clear label, and the mean
    P(positive) it gives to held-out text without one."""
    import torch
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=CONTEXT,
        dim=32,
        n_layers=1,
        n_heads=2,
        hidden_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
        num_labels=2,
        id2label={0: "NEGATIVE", 1: "POSITIVE"},
        label2id={"NEGATIVE": 0, "POSITIVE": 1},
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DistilBertForSequenceClassification(config)
    train = labelled_sentences(1200, seed + 2)
    held_out = labelled_sentences(300, seed + 3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(train, 64)
        enc = tokenizer([t for t, _ in batch], padding=True, truncation=True, return_tensors="pt")
        p = torch.tensor([y for _, y in batch])
        logits = model(**enc).logits
        loss = torch.nn.functional.cross_entropy(logits, torch.stack([1 - p, p], dim=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        enc = tokenizer([t for t, _ in held_out], padding=True, truncation=True, return_tensors="pt")
        prob = model(**enc).logits.softmax(-1)[:, 1]
    labels = torch.tensor([y for _, y in held_out])
    clear = labels != 0.5
    accuracy = float(((prob[clear] > 0.5).float() == labels[clear]).float().mean())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"accuracy": accuracy, "neutral_mean": float(prob[~clear].mean()), "final_loss": loss.item()}


def build(out: str, seed: int = 0, num_prompts: int = 256) -> dict:
    """Build the policy, the classifier and the prompt file under ``out``; their paths and the
    classifier's held-out statistics."""
    t = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    texts = corpus(seed)
    policy = build_policy(os.path.join(out, "policy"), policy_tokenizer(texts), seed)
    classifier = os.path.join(out, "classifier")
    stats = build_classifier(classifier, classifier_tokenizer(texts), seed)
    if stats["accuracy"] < 0.9:  # 0.94 to 1.0 over seeds 0-29 and CPU kernels; a constant scores 0.51
        raise RuntimeError(
            f"the classifier did not learn to tell the two apart (held-out accuracy {stats['accuracy']:.3f}, "
            f"expected at least 0.9): try another --seed"
        )
    prompts = os.path.join(out, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in review_openings(num_prompts, seed):
            f.write(json.dumps({"prompt": p}) + "\n")
    return {
        "policy": policy,
        "classifier": classifier,
        "prompts": prompts,
        "classifier_stats": stats,
        "seconds": time.perf_counter() - t,
    }


def measure(out: str, n: int = 32, new_tokens: int = 8, bias: float = 6.0, seed: int = 0) -> dict:
    """Mean reward of the tiny policy's sampled responses to ``n`` prompts: as built, with a
    ``+bias`` on the logits of the tokens of positive words, and with it on negative words."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    positive_score = _sibling("reward").positive_score
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "policy"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "policy")).eval()
    with open(os.path.join(out, "prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:n]

    def word_tokens(words: list[str]) -> list[int]:
        ids = [tok.encode(" " + w, add_special_tokens=False) for w in words]
        return sorted({i[0] for i in ids if len(i) == 1})

    def mean_reward(biased: list[int] | None) -> float:
        torch.manual_seed(seed)
        outputs = []
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            kw = {"sequence_bias": {(i,): bias for i in biased}} if biased else {}
            gen = model.generate(
                **enc, do_sample=True, max_new_tokens=new_tokens, pad_token_id=tok.eos_token_id, **kw
            )
            outputs.append(tok.decode(gen[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
        samples = [p + o for p, o in zip(prompts, outputs)]
        scores = positive_score(samples, prompts, outputs, classifier=os.path.join(out, "classifier"))
        return sum(scores) / len(scores)

    pos, neg = word_tokens(POSITIVE), word_tokens(NEGATIVE)
    return {
        "random_policy": mean_reward(None),
        "positive_bias": mean_reward(pos),
        "negative_bias": mean_reward(neg),
        "positive_tokens": len(pos),
        "negative_tokens": len(neg),
    }


def _sibling(name: str) -> Any:
    """The module ``<name>.py`` beside this file (loaded under a name of its own, so that another
    example's module of the same name is never taken for it)."""
    import importlib.util

    key = f"_sentiment_example_{name}"
    if key not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write policy/, classifier/ and prompts.jsonl into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--no-measure", action="store_true", help="skip the reward measurement")
    a = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    built = build(a.out, a.seed, a.num_prompts)
    s = built["classifier_stats"]
    print(
        f"policy: {built['policy']}\nclassifier: {built['classifier']} (held-out accuracy {s['accuracy']:.3f}, "
        f"P(positive) without a sentiment word {s['neutral_mean']:.3f})\nprompts: {built['prompts']}\n"
        f"built in {built['seconds']:.1f} s"
    )
    if not a.no_measure:
        m = measure(a.out)
        print(
            f"mean reward of sampled responses: random policy {m['random_policy']:.3f}, biased to positive "
            f"words {m['positive_bias']:.3f}, to negative words {m['negative_bias']:.3f}"
        )


if __name__ == "__main__":
    main()
