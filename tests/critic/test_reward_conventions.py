"""Reward functions written as other frameworks write them, bound by their parameters' names
(aligner.critic.reward_conventions), and how the server calls per-sample and async ones: thread
pool, concurrency, timeouts, failures naming the sample. Plain in-process tests, no servers."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from aligner.critic.errors import RequestRewardError
from aligner.critic.reward_conventions import reward_options_problems
from aligner.critic.reward_fn import (
    RewardArgumentError,
    RewardFn,
    RewardFunctionError,
    call_reward_fn,
    score_requests,
)

PROMPTS = ["1+1=", "2+3="]
RESPONSES = ["2", "six"]
PROMPT_IDS = [[1, 2, 3, 4], [5, 6, 7, 8]]
RESPONSE_IDS = [[9], [10, 11, 12]]
BATCH = (PROMPTS, RESPONSES, PROMPT_IDS, RESPONSE_IDS)
EXTRAS = [{"answer": "2", "data_source": "arith", "split": "train"}, {"answer": "5", "split": "test"}]


# ------------------------------------------------------------------------ conventions by names


def test_ours_by_name_whatever_the_order():
    def score(responses, prompts):  # order swapped: names decide, not positions
        return [float(len(r)) for r in responses]

    fn = RewardFn(score, "m:score")
    assert fn.convention == "aligner"
    assert fn(*BATCH) == [1.0, 3.0]


def test_trlx():
    seen = {}

    def reward_fn(samples, prompts, outputs, **kwargs):
        seen.update(samples=samples, prompts=prompts, outputs=outputs, kwargs=kwargs)
        return [0.0] * len(samples)

    fn = RewardFn(reward_fn, "m:reward_fn")
    assert fn.convention == "trlx"
    fn(*BATCH, EXTRAS)
    assert seen["samples"] == ["1+1=2", "2+3=six"]
    assert seen["prompts"] == PROMPTS and seen["outputs"] == RESPONSES
    assert seen["kwargs"]["answer"] == ["2", "5"] and seen["kwargs"]["response_ids"] == RESPONSE_IDS


def test_trl_completions_only_gets_the_responses_and_columns_by_keyword():
    seen = {}

    def length_reward(completions, **kwargs):
        seen["kwargs"] = kwargs
        return [float(len(c)) for c in completions]

    fn = RewardFn(length_reward, "m:length_reward")
    assert fn.convention == "trl"
    assert fn(*BATCH, EXTRAS) == [1.0, 3.0]  # the responses' lengths, not the prompts'
    kw = seen["kwargs"]
    assert kw["prompts"] == PROMPTS and kw["completion_ids"] == RESPONSE_IDS
    assert kw["answer"] == ["2", "5"] and kw["split"] == ["train", "test"]
    assert kw["data_source"] == ["arith", None]  # a column a row lacks: None there


def test_trl_prompts_completions_and_a_named_column():
    def accuracy(prompts, completions, answer, **kwargs):
        assert prompts == PROMPTS
        return [float(c == a) for c, a in zip(completions, answer)]

    fn = RewardFn(accuracy, "m:accuracy")
    assert fn.convention == "trl" and fn.required_columns == ["answer"]
    assert fn(*BATCH, EXTRAS) == [1.0, 0.0]
    with pytest.raises(RewardArgumentError, match="required parameter 'answer'"):
        fn(*BATCH, [{}, {}])


def test_openrlhf_labels_from_the_label_column():
    seen = {}

    def reward_func(queries, prompts, labels):
        seen.update(queries=queries, prompts=prompts, labels=labels)
        return {"rewards": [float(q.endswith(lab)) for q, lab in zip(queries, labels)]}

    fn = RewardFn(reward_func, "m:reward_func")
    assert fn.convention == "openrlhf" and fn.needs_label
    extras = [{"label": "2", "answer": "x"}, {"label": "5"}]
    scores = call_reward_fn(fn, "m:reward_func", _Tok(), *_encoded(), extras)
    assert list(scores) == [1.0, 0.0]  # OpenRLHF's {"rewards": ...} answer
    assert seen["queries"] == ["1+1=2", "2+3=six"] and seen["prompts"] == PROMPTS
    assert seen["labels"] == ["2", "5"]  # 'label' before 'answer'
    # Another column, named by reward.label_column.
    fn = RewardFn(reward_func, "m:reward_func", label_column="answer")
    fn(*BATCH, EXTRAS)
    assert seen["labels"] == ["2", "5"]
    # No label column: refused up front, naming what is missing and where it was looked for.
    err = fn.argument_error(["split"])
    assert isinstance(err, RewardArgumentError)
    assert "'labels'" in str(err) and "reward.label_column='answer'" in str(err) and "['split']" in str(err)
    with pytest.raises(RewardArgumentError, match="needs each sample's label") as e:
        RewardFn(reward_func, "m:rf")(*BATCH, [{"label": "2"}, {"other": 1}])
    assert e.value.sample == 1


def test_verl_per_sample_gets_each_samples_values():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": float(solution_str == ground_truth), "acc": True}

    fn = RewardFn(compute_score, "m:compute_score", {"data_source": "default"})
    assert fn.convention == "verl" and fn.per_sample
    extras = [
        {"data_source": "gsm8k", "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 7}},
        {"ground_truth": "5", "split": "test"},
    ]
    scores = call_reward_fn(fn, "m:compute_score", _Tok(), *_encoded(), extras)
    assert list(scores) == [1.0, 0.0]
    assert seen == [
        ("gsm8k", "2", "2", {"index": 7}),  # verl's nested ground truth; extra_info merged in
        ("default", "six", "5", {"split": "test"}),  # data_source: the fn_kwargs default
    ]


def test_verl_old_style_and_fn_kwargs():
    def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
        return score if solution_str == ground_truth else format_score

    fn = RewardFn(compute_score, "m:gsm8k", {"format_score": 0.1})
    assert fn(*BATCH, EXTRAS) == [1.0, 0.1]


def test_verl_without_a_label_keeps_its_default_and_its_own_timeout_error_is_its_own():
    def compute_score(solution_str, ground_truth="none", **kwargs):
        if solution_str == "six":
            raise TimeoutError("the sandbox did not answer")
        return ground_truth

    fn = RewardFn(compute_score, "m:cs", timeout_s=5.0)
    assert not fn.needs_label
    assert fn(["1+1="], ["2"], [[1]], [[2]], [{"split": "x"}]) == ["none"]
    with pytest.raises(RewardFunctionError) as e:
        fn(*BATCH, [{}, {}])
    assert not e.value.timed_out and "TimeoutError: the sandbox did not answer" in str(e.value)


def test_verl_batched():
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        assert data_sources == ["arith", None] and extra_infos[1] == {"split": "test"}
        return [{"score": float(s == g)} for s, g in zip(solution_strs, ground_truths)]

    fn = RewardFn(compute_score, "m:batch")
    assert fn.convention == "verl_batch" and not fn.per_sample
    assert list(call_reward_fn(fn, "m:batch", _Tok(), *_encoded(), EXTRAS)) == [1.0, 0.0]


# ------------------------------------------------------------------------ refused when loaded


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (lambda prompts, responses, completions: [], ["ambiguous", "aligner (parameter 'responses')", "trl"]),
        (lambda samples, solution_str: [], ["ambiguous", "trlx", "verl"]),
        (lambda prompts, **kwargs: [], ["match none", "['prompts']", "could be those of aligner, trlx, trl"]),
        (lambda texts: texts, ["match none", "['texts']", "cannot take a batch"]),
        (lambda *args, **kwargs: [], ["match none", "parameters seen: none"]),
    ],
)
def test_ambiguous_and_unknown_signatures_are_refused(bad, words):
    with pytest.raises(ValueError) as e:
        RewardFn(bad, "m:bad")
    for w in words:
        assert w in str(e.value)
    assert "OpenRLHF's reward_func(queries, prompts, labels)" in str(e.value)


def test_options_are_checked_naming_field_value_and_expectation():
    assert reward_options_problems(1, 8, None, None) == []
    assert reward_options_problems(4, 1, 2.5, "answer") == []
    got = reward_options_problems(0, True, -1.0, "")
    assert got == [
        "reward.workers=0: expected a positive integer (>= 1)",
        "reward.concurrency=True: expected a positive integer (>= 1)",
        "reward.timeout_s=-1.0: expected a positive number of seconds, or null for no limit",
        "reward.label_column='': expected a column name of the extras, or null for the first of "
        "['label', 'labels', 'ground_truth', 'answer', 'reward_model.ground_truth']",
    ]
    assert reward_options_problems(1, 1, float("inf"), None)[0].startswith("reward.timeout_s=inf")


def test_the_config_checks_the_options_and_passes_them_on(tmp_path):
    from aligner.config_checks import ConfigError
    from aligner.critic.config import build_config
    from aligner.critic.testing import tiny_config

    r = build_config(
        tiny_config(tmp_path, reward={"workers": 4, "timeout_s": 1.5, "label_column": "y"})
    ).reward
    assert r.fn_options() == {"workers": 4, "concurrency": 8, "timeout_s": 1.5, "label_column": "y"}
    with pytest.raises(ConfigError) as e:
        build_config(tiny_config(tmp_path, reward={"workers": 0, "concurrency": -2, "timeout_s": 0.0}))
    msg = str(e.value)
    assert "reward.workers=0: expected a positive integer" in msg
    assert "reward.concurrency=-2: expected a positive integer" in msg
    assert "reward.timeout_s=0.0: expected a positive number of seconds, or null" in msg


# ------------------------------------------------------------------------ calling per sample


def _verl_batch(n: int):
    prompts = [f"{i}:" for i in range(n)]
    responses = [str(i * i) for i in range(n)]
    extras = [{"ground_truth": str(i * i if i % 3 else -1)} for i in range(n)]
    return prompts, responses, [[1]] * n, [[2]] * n, extras


def test_workers_1_and_4_give_the_same_list_in_order():
    threads = set()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        threads.add(threading.get_ident())
        time.sleep(0.001)
        return float(solution_str == ground_truth) + int(solution_str) / 1000

    batch = _verl_batch(40)
    one = RewardFn(compute_score, "m:cs")(*batch)
    assert threads == {threading.get_ident()}  # workers=1: in the caller's thread
    threads.clear()
    four = RewardFn(compute_score, "m:cs", workers=4)(*batch)
    assert one == four and len(one) == 40
    assert one[:4] == [0.0, 1.001, 1.004, 0.009]
    assert threading.get_ident() not in threads


def test_async_per_sample_runs_concurrently_up_to_the_limit():
    state = {"now": 0, "max": 0}

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return float(solution_str == ground_truth)

    batch = _verl_batch(16)
    got = RewardFn(compute_score, "m:acs", concurrency=4)(*batch)
    assert state["max"] == 4
    assert got == [0.0 if i % 3 == 0 else 1.0 for i in range(16)]
    state["max"] = 0
    RewardFn(compute_score, "m:acs", concurrency=1)(*batch)
    assert state["max"] == 1


def test_async_batch_function_is_awaited():
    async def reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    assert RewardFn(reward, "m:ar")(*BATCH) == [1.0, 3.0]


def test_a_slow_async_sample_times_out_naming_the_sample():
    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(30 if solution_str == "4" else 0)
        return 1.0

    fn = RewardFn(compute_score, "m:slow", concurrency=4, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as e:
        fn(*_verl_batch(5))
    assert time.monotonic() - start < 10
    assert e.value.sample == 2 and e.value.timed_out
    assert "reward function 'm:slow' failed on sample 2 of the request" in str(e.value)
    assert "timed out after 0.2 s (reward.timeout_s)" in str(e.value)
    assert fn.stats() == {"calls": 5, "failures": 0, "timeouts": 1}


def test_a_slow_sync_sample_times_out_and_later_calls_still_run():
    release = threading.Event()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "1":
            release.wait(30)
        return 0.5

    fn = RewardFn(compute_score, "m:slow", workers=2, timeout_s=0.3)
    try:
        with pytest.raises(RewardFunctionError, match="failed on sample 1 of the request: it timed out"):
            fn(*_verl_batch(4))
        assert fn(*_verl_batch(1)) == [0.5]  # a fresh pool, not the one a hung thread holds
    finally:
        release.set()


def test_a_raising_sample_names_its_index_and_fails_only_its_request():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "9":
            raise ValueError("cannot parse")
        return float(solution_str == ground_truth)

    for workers in (1, 3):
        fn = RewardFn(compute_score, "m:cs", workers=workers)
        with pytest.raises(RewardFunctionError) as e:
            fn(*_verl_batch(5))
        assert e.value.sample == 3 and "ValueError: cannot parse" in str(e.value)
        assert "reward function 'm:cs' failed on sample 3" in str(e.value)
    # Merged requests: the sample's request fails, naming its index there; the others score.
    tok = _Tok()
    a = (*_encoded(["0:", "1:"], ["0", "1"]), [{"ground_truth": "0"}, {"ground_truth": "1"}])
    b = (*_encoded(["2:", "3:"], ["4", "9"]), [{"ground_truth": "4"}, {"ground_truth": "9"}])
    c = (*_encoded(["4:"], ["7"]), None)  # no ground truth at all: refused up front
    out = score_requests(RewardFn(compute_score, "m:cs", workers=2), "m:cs", tok, [a, b, c])
    assert list(out[0]) == [1.0, 1.0]
    assert isinstance(out[1], RewardFunctionError) and out[1].sample == 1
    assert "ValueError: cannot parse" in str(out[1])
    assert isinstance(out[2], RewardArgumentError) and "needs each sample's label" in str(out[2])


def test_a_timed_out_batch_function_fails_its_request_without_blaming_samples():
    calls = []

    def reward(prompts, responses):
        calls.append(len(prompts))
        if "9" in responses:
            time.sleep(1.0)
        return [1.0] * len(prompts)

    tok = _Tok()
    a = _encoded(["0:"], ["1"])
    b = _encoded(["1:", "2:"], ["9", "2"])
    out = score_requests(RewardFn(reward, "m:r", timeout_s=0.2), "m:r", tok, [a, b])
    assert list(out[0]) == [1.0]
    assert isinstance(out[1], RewardFunctionError) and out[1].timed_out and out[1].sample is None
    assert calls == [3, 1, 2]  # merged, then each alone; no per-sample re-runs after a timeout


def test_bad_verl_answers_name_the_sample():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0} if solution_str == "six" else 0.0

    with pytest.raises(RewardFunctionError, match="sample 1 .*without a 'score' key"):
        call_reward_fn(RewardFn(compute_score, "m:cs"), "m:cs", _Tok(), *_encoded(), EXTRAS)


# ------------------------------------------------------------------------ helpers


class _Tok:
    """A char tokenizer's stand-in: ids are code points, 0 ends a sequence."""

    eos_id = 0

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _encoded(prompts=("1+1=", "2+3="), responses=("2", "six")):
    """``(tokens, lengths, prompt_lengths)`` of the samples (:class:`_Tok`'s ids)."""
    rows = [[ord(c) for c in p + r] for p, r in zip(prompts, responses)]
    s = max(len(r) for r in rows) + 1
    tokens = np.zeros((len(rows), s), dtype=np.int64)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows])
    return tokens, lengths, np.array([len(p) for p in prompts])


# ------------------------------------------------------------------------ through the service


SLOW_VERL = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(8 if solution_str.startswith("4") else 0)
    return {"score": 1.0}
"""


def test_the_service_calls_the_function_with_the_configured_options(pstate, tmp_path):
    """reward.timeout_s and reward.workers reach the server's function: a sample past the limit
    fails its request naming the function and the sample, and server_info counts it."""
    from _critic_service import _batch, _service

    (tmp_path / "slow_verl.py").write_text(SLOW_VERL)
    svc = _service(
        pstate,
        tmp_path,
        precision="fp32",
        reward={
            "fn": "slow_verl:compute_score",
            "python_path": [str(tmp_path)],
            "timeout_s": 0.5,
            "workers": 2,
        },
    )
    assert svc.reward_fn.workers == 2 and svc.reward_fn.timeout_s == 0.5
    tokens, lengths, pl, *_, responses = _batch(svc, b=6, seed=3)
    slow = [i for i, r in enumerate(responses) if r.startswith("4")]
    assert slow, responses  # seed 3's batch has one; the others answer at once
    t0 = time.monotonic()
    with pytest.raises(RequestRewardError) as e:
        svc.infer(tokens, lengths, pl, extras=['{"ground_truth": "x"}'] * len(responses))
    msg = str(e.value)
    assert "slow_verl:compute_score" in msg and f"sample {slow[0]}" in msg, msg
    assert "timed out after 0.5 s (reward.timeout_s)" in msg, msg
    assert time.monotonic() - t0 < 6  # not the 8 s the sample takes
    assert svc.info().reward["fn_calls"]["timeouts"] >= 1
