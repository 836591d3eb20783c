"""Prompt data sets (aligner.actor.datasets, their sources aligner.actor.sources): every source kind,
the prompt column, the extras that travel to the reward function, chat templates, length filtering,
splits, each refusal, and the sampler that carries the extras under data parallelism and across a
resume."""

from __future__ import annotations

import datetime
import json

import pytest
from _word_tokenizer import save_word_tokenizer

from aligner.actor.datasets import (
    DataConfig,
    PromptSet,
    load_prompt_set,
    training_prompt_set,
    validation_prompt_set,
)
from aligner.actor.prompts import PromptSampler, load_prompts
from aligner.config_checks import ConfigError
from aligner.tokenizers import CharTokenizer, build_tokenizer

WORDS = "what is two plus four say hi hello world you are helpful a b c d e f g h".split()
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROWS = [
    {"prompt": "what is two plus two", "answer": "four", "id": 1},
    {"prompt": "say hi", "answer": "hi", "id": 2},
    {"prompt": "a b c d e f g h", "answer": "long", "id": 3},
    {"prompt": "hello world", "answer": "hello", "id": 4},
]
EXTRAS = [
    '{"answer":"four","id":1}',
    '{"answer":"hi","id":2}',
    '{"answer":"long","id":3}',
    '{"answer":"hello","id":4}',
]


def _hf_tokenizer(folder, template: str | None):
    """A word-level HF tokenizer (one token per word, role markers as special tokens)."""
    save_word_tokenizer(folder, WORDS, template)
    return build_tokenizer(str(folder))


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return _hf_tokenizer(tmp_path_factory.mktemp("chat_tok"), TEMPLATE)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    return _hf_tokenizer(tmp_path_factory.mktemp("plain_tok"), None)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "hf_cache")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _write(kind: str, tmp_path, rows) -> str:
    """``rows`` as a source of kind ``kind``; returns its path."""
    import datasets

    if kind == "jsonl":
        return _jsonl(tmp_path / "rows.jsonl", rows)
    if kind == "json":  # a JSON array of objects
        (tmp_path / "rows.json").write_text(json.dumps(rows))
        return str(tmp_path / "rows.json")
    ds = datasets.Dataset.from_list(rows)
    if kind == "csv":
        ds.to_csv(str(tmp_path / "rows.csv"), index=False)
        return str(tmp_path / "rows.csv")
    if kind == "parquet":
        ds.to_parquet(str(tmp_path / "rows.parquet"))
        return str(tmp_path / "rows.parquet")
    assert kind == "disk"
    ds.save_to_disk(str(tmp_path / "rows_ds"))
    return str(tmp_path / "rows_ds")


# -- sources, columns, extras -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "disk"])
def test_every_source_kind_gives_the_prompts_and_extras(tmp_path, plain_tok, cache, kind):
    src = _write(kind, tmp_path, ROWS)
    got = load_prompt_set(src, plain_tok, 100, cache_dir=cache)
    assert got.prompts == [r["prompt"] for r in ROWS]
    assert got.extras == EXTRAS  # compact, sorted keys; the prompt column is not among them
    assert got.lengths == [5, 2, 8, 2]  # one token per word
    assert got.stats == {
        "source": src,
        "split": "train",
        "rows": 4,
        "read": 4,
        "too_long": 0,
        "kept": 4,
        "max_prompt_tokens": 100,
        "max_prompts": None,
        "chat_template": False,
        "prompt_tokens_mean": 17 / 4,
        "prompt_tokens_max": 8,
    }


def test_nested_and_unicode_extras_are_exact_json(tmp_path, plain_tok):
    rows = [{"z": [1, 2.5, None], "prompt": "say hi", "meta": {"b": True, "a": "é"}}]
    got = load_prompt_set(_jsonl(tmp_path / "p.jsonl", rows), plain_tok, 10)
    assert got.extras == ['{"meta":{"a":"é","b":true},"z":[1,2.5,null]}']
    assert json.loads(got.extras[0]) == {"z": [1, 2.5, None], "meta": {"b": True, "a": "é"}}


def test_prompt_column_and_extra_columns_selection(tmp_path, plain_tok, cache):
    rows = [{"question": "say hi", "gold": "hi", "source": "x"}, {"question": "hello world", "gold": "hello"}]
    src = _jsonl(tmp_path / "q.jsonl", rows)
    got = load_prompt_set(src, plain_tok, 10, prompt_column="question")
    # A JSONL row without a key reads as None there, as datasets reads it.
    assert got.extras == ['{"gold":"hi","source":"x"}', '{"gold":"hello","source":null}']
    got = load_prompt_set(src, plain_tok, 10, prompt_column="question", extra_columns=["gold"])
    assert got.prompts == ["say hi", "hello world"] and got.extras == ['{"gold":"hi"}', '{"gold":"hello"}']
    assert load_prompt_set(src, plain_tok, 10, prompt_column="question", extra_columns=[]).extras is None
    # The prompt column itself may travel too (e.g. the text before a chat template).
    got = load_prompt_set(src, plain_tok, 10, prompt_column="question", extra_columns=["question"])
    assert got.extras == ['{"question":"say hi"}', '{"question":"hello world"}']
    # No other column: no extras at all.
    only = _write("parquet", tmp_path, [{"prompt": "say hi"}])
    assert load_prompt_set(only, plain_tok, 10, cache_dir=cache).extras is None


def test_dataset_dict_splits_slices_and_validation(tmp_path, plain_tok):
    import datasets

    train = [{"prompt": f"say {w}", "k": i} for i, w in enumerate("a b c d e f".split())]
    test = [{"prompt": "hello world", "k": 100}, {"prompt": "say hi", "k": 101}]
    folder = str(tmp_path / "dd")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(folder)
    assert load_prompt_set(folder, plain_tok, 10).prompts == [r["prompt"] for r in train]
    got = load_prompt_set(folder, plain_tok, 10, split="test")
    assert got.prompts == ["hello world", "say hi"] and got.extras == ['{"k":100}', '{"k":101}']
    assert got.stats["split"] == "test"
    assert load_prompt_set(folder, plain_tok, 10, split="train[-2:]").prompts == ["say e", "say f"]
    assert load_prompt_set(folder, plain_tok, 10, split="train[:50%]").prompts == ["say a", "say b", "say c"]
    both = load_prompt_set(folder, plain_tok, 10, split="train[:1]+test")
    assert both.prompts == ["say a", "hello world", "say hi"]

    data = DataConfig(dataset=folder, val_split="test", extra_columns=["k"])
    assert training_prompt_set(data, plain_tok, 10).extras == [f'{{"k":{i}}}' for i in range(6)]
    val = validation_prompt_set(data, None, 1, plain_tok, 10)
    assert val.prompts == ["hello world"] and val.extras == ['{"k":100}']
    data.val_split = "train[-1:]"
    assert validation_prompt_set(data, None, 64, plain_tok, 10).prompts == ["say f"]
    with pytest.raises(ConfigError, match="expected one source of validation prompts"):
        validation_prompt_set(data, _jsonl(tmp_path / "v.jsonl", test), 4, plain_tok, 10)
    data.val_split = None
    assert validation_prompt_set(data, None, 4, plain_tok, 10) is None  # the caller takes training's first


def test_prompt_file_goes_through_the_same_loader(tmp_path, plain_tok):
    src = _jsonl(tmp_path / "p.jsonl", ROWS)
    data = DataConfig(prompt_file=src, val_split="train[-1:]", max_prompts=2)
    got = training_prompt_set(data, plain_tok, 100)
    assert got.prompts == ["what is two plus two", "say hi"] and got.extras == EXTRAS[:2]
    assert (
        got.summary()
        == f"data: kept 2 of 2 prompts from {src} (0 longer than 100 tokens dropped; stopped at max_prompts=2, 4 rows in all)"
    )
    assert validation_prompt_set(data, None, 8, plain_tok, 100).prompts == ["hello world"]
    assert load_prompts(src, plain_tok, 100) == [r["prompt"] for r in ROWS]
    # validation.prompt_file is read like the training data: same prompt column and extras.
    val = validation_prompt_set(DataConfig(extra_columns=["id"]), src, 2, plain_tok, 100)
    assert val.prompts == ["what is two plus two", "say hi"] and val.extras == ['{"id":1}', '{"id":2}']


# -- chat templates ---------------------------------------------------------------------------


def test_chat_template_renders_prompts_and_counts_tokens_after_it(tmp_path, chat_tok, cache):
    src = _write("parquet", tmp_path, ROWS[:2])
    got = load_prompt_set(src, chat_tok, 100, chat_template=True, cache_dir=cache)
    assert got.prompts == [
        "<|user|> what is two plus two <|assistant|>",
        "<|user|> say hi <|assistant|>",
    ]
    assert got.lengths == [7, 4]  # the markers are one token each
    assert got.extras == EXTRAS[:2]
    assert got.texts == ["what is two plus two", "say hi"] and got.head(1).texts == got.texts[:1]
    assert (
        load_prompt_set(src, chat_tok, 100, cache_dir=cache).texts is None
    )  # no template: the prompt itself
    sys_ = load_prompt_set(
        src, chat_tok, 100, chat_template=True, system_prompt="you are helpful", cache_dir=cache
    )
    assert sys_.prompts[1] == "<|system|> you are helpful <|user|> say hi <|assistant|>"
    assert sys_.lengths[1] == 8
    # the template is the tokenizer's own: the same text as transformers renders
    msgs = [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "say hi"}]
    assert sys_.prompts[1] == chat_tok.hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    # 7 tokens do not fit in 6: counted after the template, dropped and counted
    cut = load_prompt_set(src, chat_tok, 6, chat_template=True, cache_dir=cache)
    assert cut.prompts == ["<|user|> say hi <|assistant|>"] and cut.extras == EXTRAS[1:2]
    assert cut.stats["too_long"] == 1 and cut.stats["kept"] == 1


def test_chat_format_rows_are_templated_as_they_are(tmp_path, chat_tok, cache):
    rows = [
        {"messages": [{"role": "user", "content": "say hi"}], "id": 1},
        {
            "messages": [
                {"role": "system", "content": "you are helpful"},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "say world"},
            ],
            "id": 2,
        },
    ]
    for src in (_jsonl(tmp_path / "chat.jsonl", rows), _write("parquet", tmp_path, rows)):
        got = load_prompt_set(
            src,
            chat_tok,
            100,
            prompt_column="messages",
            chat_template=True,
            system_prompt="a b",
            cache_dir=cache,
        )
        assert got.prompts == [
            "<|system|> a b <|user|> say hi <|assistant|>",  # the system prompt goes first...
            # ...unless the row has its own system message
            "<|system|> you are helpful <|user|> hello <|assistant|> hi <|user|> say world <|assistant|>",
        ]
        assert got.extras == ['{"id":1}', '{"id":2}']
        assert got.texts == ["say hi", "say world"]  # as written: the last user message
    answered = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    with pytest.raises(ConfigError, match='answered.jsonl:1: "messages" ends with an assistant message'):
        load_prompt_set(
            _jsonl(tmp_path / "answered.jsonl", answered),
            chat_tok,
            100,
            prompt_column="messages",
            chat_template=True,
            cache_dir=cache,
        )


# -- filtering --------------------------------------------------------------------------------


def test_too_long_prompts_are_dropped_and_counted(tmp_path, plain_tok):
    src = _jsonl(tmp_path / "p.jsonl", ROWS)
    got = load_prompt_set(src, plain_tok, 5)  # lengths 5, 2, 8, 2: the third is dropped
    assert got.prompts == ["what is two plus two", "say hi", "hello world"]
    assert got.extras == [EXTRAS[0], EXTRAS[1], EXTRAS[3]]  # extras stay with their prompts
    assert got.lengths == [5, 2, 2]
    assert (got.stats["read"], got.stats["too_long"], got.stats["kept"]) == (4, 1, 3)
    assert got.summary() == f"data: kept 3 of 4 prompts from {src} (1 longer than 5 tokens dropped)"
    # max_prompts counts kept prompts, after the filter
    two = load_prompt_set(src, plain_tok, 4, max_prompts=2)
    assert two.prompts == ["say hi", "hello world"]
    assert (two.stats["read"], two.stats["too_long"], two.stats["kept"], two.stats["rows"]) == (4, 2, 2, 4)
    head = got.head(2)
    assert isinstance(head, PromptSet) and head.prompts == got.prompts[:2] and head.extras == got.extras[:2]
    with pytest.raises(ConfigError, match="all 4 prompts are longer than the 1 tokens") as e:
        load_prompt_set(src, plain_tok, 1)
    assert "p.jsonl:1: prompt has 5 tokens, more than the 1 that fit" in str(e.value)


# -- refusals ---------------------------------------------------------------------------------


def test_refusals_name_the_row_column_or_split(tmp_path, plain_tok, cache):
    pq = _write("parquet", tmp_path, ROWS)
    with pytest.raises(ConfigError) as e:
        load_prompt_set(pq, plain_tok, 10, prompt_column="question", cache_dir=cache)
    assert "has no column 'question' (its columns: 'prompt', 'answer', 'id')" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_prompt_set(pq, plain_tok, 10, extra_columns=["id", "gold"], cache_dir=cache)
    assert "data.extra_columns=['id', 'gold']" in str(e.value) and "no column(s) 'gold'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_prompt_set(pq, plain_tok, 10, split="test", cache_dir=cache)
    assert "has no split 'test' (its splits: 'train')" in str(e.value)
    with pytest.raises(ConfigError, match="not a split the datasets library understands"):
        load_prompt_set(pq, plain_tok, 10, split="train[x]", cache_dir=cache)
    with pytest.raises(ConfigError, match=r"holds no prompts: split 'train\[3:1\]' has no rows"):
        load_prompt_set(pq, plain_tok, 10, split="train[3:1]", cache_dir=cache)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        load_prompt_set(str(empty), plain_tok, 10)
    with pytest.raises(ConfigError, match="no such file or folder"):
        load_prompt_set(str(tmp_path / "missing.parquet"), plain_tok, 10)
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ConfigError, match="unknown data file type '.txt'"):
        load_prompt_set(str(tmp_path / "rows.txt"), plain_tok, 10)


@pytest.mark.parametrize("tok", ["char", "plain"])
def test_a_chat_template_needs_a_tokenizer_that_has_one(tmp_path, plain_tok, tok):
    src = _jsonl(tmp_path / "p.jsonl", ROWS)
    tokenizer = CharTokenizer() if tok == "char" else plain_tok
    with pytest.raises(ConfigError) as e:
        load_prompt_set(src, tokenizer, 10, chat_template=True)
    msg = str(e.value)
    assert (
        "has no chat template" in msg and "data.chat_template=false" in msg and "HF tokenizer folder" in msg
    )


def test_bad_prompts_are_reported_by_row(tmp_path, plain_tok, chat_tok):
    import datasets

    rows = [{"prompt": "say hi"}, {"prompt": 5}, {"prompt": ""}, {"prompt": None}, {"prompt": ["say hi"]}]
    with pytest.raises(ConfigError) as e:
        load_prompt_set(_jsonl(tmp_path / "p.jsonl", rows), plain_tok, 10)
    msg = str(e.value)
    assert 'p.jsonl:2: "prompt" holds 5 (int): expected a non-empty string' in msg
    assert 'p.jsonl:3: "prompt" is empty' in msg
    assert 'p.jsonl:4: "prompt" holds None (NoneType)' in msg
    assert "p.jsonl:5" in msg and "a list of messages with data.chat_template=true" in msg
    # the same from an Arrow data set: the split and the row index
    folder = str(tmp_path / "ds")
    datasets.Dataset.from_dict({"prompt": ["say hi", "hello", None]}).save_to_disk(folder)
    with pytest.raises(ConfigError, match=r"split 'train' row 2: \"prompt\" holds None"):
        load_prompt_set(folder, plain_tok, 10)
    # chat-format rows must be {"role", "content"} messages
    bad = [{"prompt": [{"role": "user"}]}]
    with pytest.raises(ConfigError, match=r"p2.jsonl:1: \"prompt\" message 0 is \{'role': 'user'\}"):
        load_prompt_set(_jsonl(tmp_path / "p2.jsonl", bad), chat_tok, 10, chat_template=True)


def test_bad_jsonl_lines_keep_their_line_numbers(tmp_path, plain_tok):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "say hi"}\nnot json\n\n[1, 2]\n')
    with pytest.raises(ConfigError) as e:
        training_prompt_set(DataConfig(prompt_file=str(path)), plain_tok, 10)
    msg = str(e.value)
    assert "data.prompt_file=" in msg and "p.jsonl:2: not valid JSON" in msg
    assert "p.jsonl:4: expected a JSON object (one row per line), got [1, 2]" in msg
    deep = '{"prompt": "say hi", "x": ' + "[" * 200_000 + "]" * 200_000 + "}"
    path.write_text('{"prompt": "say hi"}\n' + deep + "\n")
    with pytest.raises(ConfigError, match="p.jsonl:2: JSON nested deeper than this reader can follow"):
        training_prompt_set(DataConfig(prompt_file=str(path)), plain_tok, 10)
    path.write_text('{"prompt": "say hi"}\n{"prompt": "say zz x"}\n')
    with pytest.raises(ConfigError, match="p.jsonl:2: character 'z'"):
        load_prompt_set(str(path), CharTokenizer("sayhi "), 10)


def test_extras_that_json_cannot_hold_are_refused(tmp_path, plain_tok):
    import datasets

    folder = str(tmp_path / "ds")
    when = datetime.datetime(2024, 1, 2)
    datasets.Dataset.from_dict({"prompt": ["say hi", "hello"], "when": [when, when]}).save_to_disk(folder)
    with pytest.raises(ConfigError) as e:
        load_prompt_set(folder, plain_tok, 10)
    msg = str(e.value)
    assert "split 'train' row 0: extra column 'when' holds datetime.datetime(2024, 1, 2, 0, 0)" in msg
    assert "not JSON-serialisable" in msg and "data.extra_columns" in msg
    assert load_prompt_set(folder, plain_tok, 10, extra_columns=[]).prompts == ["say hi", "hello"]
    path = tmp_path / "nan.jsonl"
    path.write_text('{"prompt": "say hi", "score": NaN}\n')
    with pytest.raises(
        ConfigError, match=r"p?nan.jsonl:1: extra column 'score' holds nan .*no NaN or infinity"
    ):
        load_prompt_set(str(path), plain_tok, 10)


def test_data_config_checks_the_new_keys(tmp_path):
    def problems(**kw):
        return "\n".join(DataConfig(**kw).problems(max_new_tokens=8, max_seq_len=32))

    src = _jsonl(tmp_path / "p.jsonl", ROWS)
    assert problems(dataset=src, split="train[:10]", val_split="train[-4:]", extra_columns=["id"]) == ""
    assert problems(dataset="org/name", dataset_config="default") == ""  # a hub name: checked when read
    assert "data.dataset='missing.parquet'" in problems(dataset="missing.parquet")
    assert "expected one of them" in problems(dataset=src, prompt_file=src)
    assert "data.dataset_config='x': expected null for a local data.dataset" in problems(
        dataset=src, dataset_config="x"
    )
    assert "data.system_prompt='be nice': expected null without data.chat_template=true" in problems(
        dataset=src, system_prompt="be nice"
    )
    assert "data.max_prompts=0" in problems(dataset=src, max_prompts=0)
    assert "data.extra_columns=['a', 'a']" in problems(dataset=src, extra_columns=["a", "a"])
    assert "data.prompt_column=''" in problems(prompt_file=src, prompt_column="")
    assert "data.split=''" in problems(prompt_file=src, split="")
    # the built-in task takes none of them
    assert "data.val_split='test': expected null with the built-in task" in problems(val_split="test")
    assert "data.chat_template=True" in problems(chat_template=True)


# -- the sampler carries the extras -----------------------------------------------------------


@pytest.mark.parametrize("balanced", [False, True])
def test_next_rows_keeps_extras_with_their_prompts(balanced):
    n = 12
    prompts = [f"p{i}" for i in range(n)]
    extras = [json.dumps({"i": i}) for i in range(n)]
    lengths = [(i * 7) % 5 + 1 for i in range(n)] if balanced else None
    ranks = [PromptSampler(prompts, 6, r, 3, seed=5, lengths=lengths, extras=extras) for r in range(3)]
    twins = [PromptSampler(prompts, 6, r, 3, seed=5, lengths=lengths) for r in range(3)]
    for _step in range(5):  # past two epochs of two steps each
        shares = [s.next_rows() for s in ranks]
        for (p, x), twin in zip(shares, twins):
            assert p == twin.next_batch()  # the same prompts next_batch draws
            assert [json.loads(e)["i"] for e in x] == [int(q[1:]) for q in p]
        drawn = sorted(int(q[1:]) for p, _ in shares for q in p)
        assert len(drawn) == 6 and len(set(drawn)) == 6  # the ranks split the step without overlap
    assert ranks[0].epoch == 2
    resumed = PromptSampler(prompts, 6, 1, 3, seed=5, lengths=lengths, extras=extras)
    resumed.load_state_dict(ranks[1].state_dict())
    assert [resumed.next_rows() for _ in range(3)] == [ranks[1].next_rows() for _ in range(3)]


def test_sampler_without_extras_and_mismatched_extras():
    s = PromptSampler(["a", "b"], 2, 0, 1, seed=0, shuffle=False)
    assert s.next_rows() == (["a", "b"], None)
    with pytest.raises(ValueError, match="extras: 1 extras for 2 prompts"):
        PromptSampler(["a", "b"], 2, 0, 1, seed=0, extras=["{}"])


def test_the_actor_entry_point_picks_itsvalidation_prompts(tmp_path, plain_tok):
    """examples/train_actor.py: data.val_split, else validation.prompt_file, else the training
    prompts' first rows (with their extras), else the built-in task."""
    from aligner.actor.config import ActorConfig
    from aligner.actor.run import validation_prompts

    cfg = ActorConfig()
    cfg.generation.max_new_tokens = 8  # room for the tiny model's prompts
    cfg.validation.num_prompts = 2
    task_prompts, extras, val_set = validation_prompts(cfg, CharTokenizer(), None)
    assert len(task_prompts) == 2 and extras is None and val_set is None

    cfg.data.dataset = _jsonl(tmp_path / "p.jsonl", ROWS)
    train_set = training_prompt_set(cfg.data, plain_tok, 24)
    assert validation_prompts(cfg, plain_tok, train_set) == (train_set.prompts[:2], EXTRAS[:2], None)
    cfg.validation.prompt_file = _jsonl(tmp_path / "v.jsonl", ROWS[3:])
    prompts, extras, val_set = validation_prompts(cfg, plain_tok, train_set)
    assert (prompts, extras, val_set.stats["kept"]) == (["hello world"], EXTRAS[3:], 1)
    cfg.validation.prompt_file, cfg.data.val_split = None, "train[1:2]"
    assert validation_prompts(cfg, plain_tok, train_set)[:2] == (["say hi"], EXTRAS[1:2])
