"""The GSM8K reward (aligner/tasks/gsm8k.py): the final number of a response against the data
set's ``#### N`` answer, and its call by the server as ``reward.fn=aligner.tasks.gsm8k:gsm8k_reward``."""

from __future__ import annotations

from decimal import Decimal

import pytest

from aligner.tasks.gsm8k import extract_answer, gsm8k_reward, reference_answer, score

# A row of openai/gsm8k (configuration main): the worked solution ends in "#### <answer>".
SOLUTION = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18"
)


@pytest.mark.parametrize(
    "text, want",
    [
        ("She makes 9 * 2 = 18 dollars.\n#### 18", Decimal(18)),
        ("#### 18\n\nQuestion: what is 3 + 4?", Decimal(18)),  # the first number after the mark
        ("first #### 5, then #### 7", Decimal(7)),  # the last mark
        ("#### $1,234", Decimal(1234)),
        ("####-3", Decimal(-3)),
        ("#### 18.00", Decimal("18.00")),
        ("So the answer is 42.", Decimal(42)),  # no mark: the last number; a full stop is no decimal
        ("3 + 4 = 7, then 7 * 2 = 14", Decimal(14)),
        ("It costs $1,234.50 in all", Decimal("1234.50")),
        ("12 came before #### and nothing after", Decimal(12)),  # a mark without a number
        ("no number at all", None),
        ("", None),
    ],
)
def test_extract_answer_reads_the_final_number(text, want):
    assert extract_answer(text) == want


def test_strict_extraction_reads_only_the_marked_answer():
    assert extract_answer("#### 18", strict=True) == 18
    assert extract_answer("the answer is 18", strict=True) is None
    assert extract_answer("#### none, 18", strict=True) == 18
    assert extract_answer("18 ####", strict=True) is None


@pytest.mark.parametrize(
    "answer, want",
    [
        (SOLUTION, Decimal(18)),
        ("Total: 1,000 + 234 = 1,234\n#### 1,234", Decimal(1234)),
        ("#### -5", Decimal(-5)),
        ("#### 18 dollars", Decimal(18)),
        ("72", Decimal(72)),  # a plain label, as other data sets write it
        (" 3.5 ", Decimal("3.5")),
        (72, Decimal(72)),
        (2.5, Decimal("2.5")),
    ],
)
def test_reference_answer_reads_the_solutions_tail(answer, want):
    assert reference_answer(answer) == want


@pytest.mark.parametrize("answer", ["seventy-two", "72 apples", "#### ?", "", True, None])
def test_an_answer_without_a_number_is_an_error_naming_it(answer):
    with pytest.raises(ValueError, match=r"answer\[3\]="):
        reference_answer(answer, "answer[3]")


def test_score_compares_values():
    assert score("so she makes $18.\n#### 18", SOLUTION) == 1.0
    assert score("#### 18.0", SOLUTION) == 1.0  # the same value, written otherwise
    assert score("The answer is 18", SOLUTION) == 1.0
    assert score("The answer is 18", SOLUTION, strict=True) == 0.0
    assert score("#### 17", SOLUTION) == 0.0
    assert score("#### 17", SOLUTION, format_reward=0.1) == 0.1
    assert score("I do not know", SOLUTION, format_reward=0.1) == 0.0


def test_the_batch_function_scores_each_response_against_its_row():
    responses = ["#### 18", "it is 7", "#### 19", "no idea"]
    answers = [SOLUTION, "#### 7", SOLUTION, "#### 3"]
    assert gsm8k_reward(["q"] * 4, responses, answer=answers) == [1.0, 1.0, 0.0, 0.0]
    assert gsm8k_reward(["q"] * 4, responses, answer=answers, format_reward=0.1) == [1.0, 1.0, 0.1, 0.0]
    # Token ids and other columns, as the server passes them, are ignored.
    assert gsm8k_reward(["q"], ["#### 18"], answer=[SOLUTION], response_ids=[[1]], question=["q"]) == [1.0]
    with pytest.raises(ValueError, match="answer has 1 values for 2 responses"):
        gsm8k_reward(["q", "q"], ["1", "2"], answer=["#### 1"])
    with pytest.raises(ValueError, match=r"answer\[1\]='n/a'"):
        gsm8k_reward(["q", "q"], ["1", "2"], answer=["#### 1", "n/a"])


def test_the_server_calls_it_with_the_answer_column():
    """As ``reward.fn=aligner.tasks.gsm8k:gsm8k_reward`` with ``+reward.fn_kwargs.format_reward``:
    the actor's extras (``data.extra_columns=[answer]``) arrive as the keyword argument."""
    from aligner.critic.reward_fn import RewardArgumentError, load_reward_fn, reward_fn_problem

    path = "aligner.tasks.gsm8k:gsm8k_reward"
    assert reward_fn_problem(path) is None
    fn = load_reward_fn(path, {"format_reward": 0.1})
    extras = [{"answer": SOLUTION}, {"answer": "#### 7"}, {"answer": "#### 3"}]
    out = fn(["q1", "q2", "q3"], ["#### 18", "#### 8", "nothing"], [[1]] * 3, [[2]] * 3, extras)
    assert list(out) == [1.0, 0.1, 0.0]
    # A request without the column fails naming it, never scoring zeros.
    with pytest.raises(RewardArgumentError, match="'answer'"):
        fn(["q1"], ["#### 18"], [[1]], [[2]], [{"question": "q1"}])
