"""The actor's step parts on one process without a server: the prompt order and its groups,
minibatch orders and per-row sampling, dynamic sampling, the trainer's score shaping,
estimators and reward inputs, log-probs over the action space, the LR schedule's resume position,
and a step's metrics and timers."""

from __future__ import annotations

import random
import time

import pytest
import torch
from _actor_parts import ONE_RANK

from aligner.actor.config import ActorConfig
from aligner.actor.logprobs import PolicyLogprobs
from aligner.actor.optimizer import lr_lambda, set_schedule_position
from aligner.actor.prompts import PromptSampler
from aligner.actor.rollout import StepRecord
from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.metrics import Timers
from aligner.tokenizers import CharTokenizer
from aligner.wire.protocol import TrainResult

# -- prompts -----------------------------------------------------------------------------------


def test_prompt_shares_cover_the_global_batch_and_resume_where_they_stopped():
    prompts = [f"p{i}" for i in range(10)]
    ranks = [PromptSampler(prompts, 4, r, 2, seed=3) for r in range(2)]
    first = [s.next_batch() for s in ranks]
    assert all(len(x) == 2 for x in first) and not set(first[0]) & set(first[1])
    for _ in range(2):  # into the second epoch: 2 full batches per epoch, then a reshuffle
        for s in ranks:
            s.next_batch()
    assert ranks[0].epoch == 1
    resumed = PromptSampler(prompts, 4, 0, 2, seed=3)
    resumed.load_state_dict(ranks[0].state_dict())
    assert [resumed.next_batch() for _ in range(4)] == [ranks[0].next_batch() for _ in range(4)]
    with pytest.raises(ValueError, match="fewer than ppo.global_batch_size"):
        PromptSampler(prompts[:3], 4, 0, 1, seed=0)


def test_balanced_shares_deal_the_step_longest_first_in_snake_order():
    # A hand-worked step: 8 prompts with these lengths, over 2 ranks and over 4.
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    prompts = [f"p{i}" for i in range(8)]
    two = [PromptSampler(prompts, 8, r, 2, seed=0, shuffle=False, lengths=lengths) for r in range(2)]
    # Longest first: ids 2(9) 6(8) 4(7) 0(5) 7(4) 3(3) 5(2) 1(1); snake over 2 ranks: 0 1 1 0 0 1 1 0.
    assert [s.next_batch() for s in two] == [["p2", "p0", "p7", "p1"], ["p6", "p4", "p3", "p5"]]
    four = [PromptSampler(prompts, 8, r, 4, seed=0, shuffle=False, lengths=lengths) for r in range(4)]
    shares = [s.next_batch() for s in four]
    assert shares == [["p2", "p1"], ["p6", "p5"], ["p4", "p3"], ["p0", "p7"]]
    # Every prompt once, and the ranks' token totals within the longest prompt of each other.
    assert sorted(sum(shares, [])) == sorted(prompts)
    totals = [sum(lengths[int(p[1:])] for p in share) for share in shares]
    assert max(totals) - min(totals) <= max(lengths)

    # On random lengths and a shuffled draw: the same shares as a naive snake deal.
    rng = random.Random(5)
    lengths = [rng.randint(1, 50) for _ in range(64)]
    prompts = [f"q{i}" for i in range(64)]
    ranks = [PromptSampler(prompts, 32, r, 4, seed=9, lengths=lengths) for r in range(4)]
    plain = PromptSampler(prompts, 32, 0, 1, seed=9)
    drawn = [int(p[1:]) for p in plain.next_batch()]
    ranked = sorted(drawn, key=lambda i: -lengths[i])
    naive = [[], [], [], []]
    for k, i in enumerate(ranked):
        lap, pos = divmod(k, 4)
        naive[pos if lap % 2 == 0 else 3 - pos].append(f"q{i}")
    assert [s.next_batch() for s in ranks] == naive
    with pytest.raises(ValueError, match="3 token counts for 64 prompts"):
        PromptSampler(prompts, 32, 0, 4, seed=9, lengths=[1, 2, 3])


def test_groups_are_whole_adjacent_copies_on_one_rank_with_their_extras():
    prompts = [f"p{i}" for i in range(12)]
    extras = [f'{{"i": {i}}}' for i in range(12)]
    # 16 samples a step in groups of 4 over 2 ranks: 4 prompts a step, 2 per rank, each 4 times.
    ranks = [PromptSampler(prompts, 16, r, 2, seed=3, extras=extras, samples_per_prompt=4) for r in range(2)]
    plain = PromptSampler(prompts, 4, 0, 1, seed=3)  # the same 4 prompts a step, one sample each
    for _ in range(4):  # into the second epoch (3 steps of 4 prompts per epoch)
        rows = [s.next_rows() for s in ranks]
        drawn = plain.next_batch()
        for (got, ex), want in zip(rows, (drawn[:2], drawn[2:])):
            assert got == [p for p in want for _ in range(4)]
            assert ex == [f'{{"i": {p[1:]}}}' for p in got]
    assert ranks[0].state_dict() == plain.state_dict() == {"epoch": 1, "index": 4}
    # samples_per_prompt given per call wins over the constructor's
    first = PromptSampler(prompts, 2, 0, 1, seed=3).next_batch()
    assert PromptSampler(prompts, 6, 0, 1, seed=3).next_batch(3) == [p for p in first for _ in range(3)]
    with pytest.raises(
        ValueError, match="samples_per_prompt=3: expected an integer >= 1 that divides the 16"
    ):
        ranks[0].next_rows(3)
    # Balanced dealing deals whole groups by length (a group's copies have one length).
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    eight = [f"p{i}" for i in range(8)]
    two = [
        PromptSampler(eight, 16, r, 2, seed=0, shuffle=False, lengths=lengths, samples_per_prompt=2)
        for r in range(2)
    ]
    assert [s.next_batch() for s in two] == [
        ["p2", "p2", "p0", "p0", "p7", "p7", "p1", "p1"],
        ["p6", "p6", "p4", "p4", "p3", "p3", "p5", "p5"],
    ]


def test_minibatch_orders_permute_whole_groups():
    from aligner.actor.policy_update import group_order

    g = torch.Generator().manual_seed(0)
    for b, n in ((12, 3), (16, 4), (8, 8)):
        order = group_order(b, n, g)
        assert sorted(order.tolist()) == list(range(b))
        blocks = order.reshape(-1, n)
        assert torch.equal(
            blocks - blocks[:, :1], torch.arange(n).expand_as(blocks)
        )  # groups whole, in order
        assert (blocks[:, 0] % n == 0).all()
    orders = {tuple(group_order(12, 3, g).tolist()) for _ in range(20)}
    assert len(orders) > 1  # and they are shuffled
    # one sample per prompt: exactly the permutation PPO drew before groups existed
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(group_order(10, 1, a), torch.randperm(10, generator=b))
    with pytest.raises(ValueError, match="10 rows do not split into groups of 4"):
        group_order(10, 4, g)


def test_copies_of_one_prompt_draw_their_own_samples():
    """The engines sample every row of a batch from its own draw (one uniform number per row per
    step from the call's generator), so identical rows, a group's copies, sample different
    tokens; the same seed draws the same ones again."""
    from aligner.generation.sampling import rank_generator, sample_next

    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(1)).expand(16, 12)
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)
    draws = [sample_next(logits, sampling, rank_generator(5, 0, torch.device("cpu")))[0] for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert len(set(draws[0].tolist())) > 3


def _gen(rows: list[list[int]], prompt_len: int = 2, pad: int = 13) -> GenerationOutput:
    """A generation output of ``rows`` (prompt + response ids), right padded."""
    s = max(len(r) for r in rows)
    tokens = torch.tensor([r + [pad] * (s - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    logprobs = torch.zeros(len(rows), s - 1)
    for i, n in enumerate(lengths.tolist()):
        logprobs[i, prompt_len - 1 : n - 1] = -(i + 1.0)
    ended = lengths < s
    return GenerationOutput(tokens, lengths, torch.full_like(lengths, prompt_len), logprobs, ended)


def test_dynamic_sampling_keeps_informative_groups_and_fills_up_with_the_rest():
    from aligner.actor.rollout import GroupFilter, cat_generations, informative_groups

    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [
        False,
        True,
        False,
    ]
    # Round 1: groups of 2; group 1 differs, groups 0 and 2 do not.
    r1 = _gen([[1, 2, 3], [1, 2, 4, 5], [6, 7, 8], [6, 7, 9], [4, 4, 4], [4, 4, 5, 6, 7]])
    s1 = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    v1 = torch.arange(6.0).unsqueeze(1).expand(6, 4).clone()
    fill = GroupFilter(capacity=6, group_size=2, pad_id=13)
    fill.add(r1, v1, s1)
    assert (fill.rows, fill.missing, fill.filtered) == (2, 4, 2)
    # Round 2: two informative groups, of which one fits, and more than the batch needs is dropped.
    r2 = _gen([[3, 3, 1], [3, 3, 2], [5, 5, 1], [5, 5, 0], [8, 8, 8], [8, 8, 8]])
    fill.add(r2, torch.full((6, 2), 9.0), torch.tensor([0.0, 1.0, 1.0, 0.0, 0.2, 0.2]))
    assert (fill.rows, fill.missing, fill.filtered) == (6, 0, 3)
    gen, values, scores = fill.batch()
    assert scores.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    # each part trimmed to its longest row (3 tokens here), as the engines' outputs are
    assert gen.tokens.tolist() == [[6, 7, 8], [6, 7, 9], [3, 3, 1], [3, 3, 2], [5, 5, 1], [5, 5, 0]]
    assert gen.lengths.tolist() == [3] * 6 and values.shape == (6, 2)
    assert values.tolist() == [[2.0, 2.0], [3.0, 3.0]] + [[9.0, 9.0]] * 4
    # Rounds ran out before the batch was full: filled up with groups of equal scores, in order.
    short = GroupFilter(capacity=6, group_size=2, pad_id=13)
    short.add(r1, v1, s1)
    gen, values, scores = short.batch()
    assert scores.tolist() == [0.0, 1.0, 1.0, 1.0, 0.5, 0.5]
    assert gen.tokens[:, :5].tolist()[4:] == [[4, 4, 4, 13, 13], [4, 4, 5, 6, 7]] and values.shape == (6, 4)
    # row 0 of r1 keeps its own log-probs (one response token), padded with 0
    assert gen.logprobs[2].tolist() == [0.0, -1.0, 0.0, 0.0] and gen.logprobs[5].tolist() == [
        0.0,
        -6.0,
        -6.0,
        -6.0,
    ]
    # concatenation pads to the longest row
    both = cat_generations([_gen([[1, 2, 3]]), _gen([[1, 2, 3, 4, 5]])], 13)
    assert both.tokens.tolist() == [[1, 2, 3, 13, 13], [1, 2, 3, 4, 5]] and both.logprobs.shape == (2, 4)


def test_the_trainer_shapes_scores_and_picks_the_estimator_the_config_names():
    """The trainer's step 5 (aligner.actor.shaping, which reads only the config, the score
    normaliser and the data-parallel group): the soft overlong penalty beside the missing-EOS one,
    and each estimator on the KL-shaped rewards, over the loss mask overlong filtering leaves."""
    from aligner import rl
    from aligner.actor.shaping import advantages_for, shape_and_estimate, shape_scores

    cfg = ActorConfig()
    cfg.generation.max_new_tokens = 8
    cfg.ppo.missing_eos_penalty, cfg.ppo.overlong_buffer, cfg.ppo.overlong_penalty = -1.0, 4, 2.0
    shaped = shape_scores(
        cfg.ppo,
        cfg.generation.max_new_tokens,
        torch.tensor([1.0, 1.0, 1.0, 1.0]),
        torch.tensor([True, True, False, True]),
        torch.tensor([3, 6, 8, 4]),
        rl.RunningMoments(),
    )
    assert shaped.tolist() == [1.0, 0.0, -2.0, 1.0]  # 6 tokens: (4 - 6) / 4 * 2; 8 without EOS: -1 - 2

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]] * 4)
    kl = torch.rand(4, 4, generator=g) * mask
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    rewards, _ = rl.shaped_rewards(scores, kl, mask, 0.1)
    values = torch.rand(4, 4, generator=g)
    loss_mask = rl.overlong_filter(mask, torch.tensor([True, True, True, False]))
    sequence = scores - 0.1 * kl.sum(1)  # what the group estimators compare: the score and its KL penalty
    cfg.ppo.samples_per_prompt = 2
    for adv, want in (
        ("grpo", rl.grpo_advantages(sequence, loss_mask, 2)),
        ("rloo", rl.rloo_advantages(sequence, loss_mask, 2)),
        ("reinforce_pp", rl.reinforce_pp_advantages(rewards, loss_mask, cfg.ppo.gamma)[0]),
        ("gae", rl.global_whiten(rl.compute_gae(rewards, values, mask, 1.0, 0.95)[0], loss_mask)),
    ):
        cfg.ppo.advantage = adv
        got, _ = advantages_for(cfg.ppo, rewards, values, mask, loss_mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=adv)
        assert not got[3].any() or adv == "gae"  # the filtered row has no advantage (GAE: no loss)
    cfg.ppo.grpo_std_norm, cfg.ppo.advantage = False, "grpo"
    got, _ = advantages_for(cfg.ppo, rewards, values, mask, loss_mask)
    torch.testing.assert_close(got, rl.grpo_advantages(sequence, loss_mask, 2, std_norm=False))

    # The whole of step 5 in one call is those pieces in a row.
    cfg.ppo.advantage, cfg.ppo.overlong_filtering = "gae", True
    ended = torch.tensor([True, True, True, False])
    old_lp, ref_lp = torch.rand(4, 4, generator=g), torch.rand(4, 4, generator=g)
    raw = torch.tensor([1.0, 0.0, 0.5, 0.5])
    got = shape_and_estimate(
        cfg.ppo,
        max_new_tokens=8,
        raw_scores=raw,
        values=values,
        ended=ended,
        response_lengths=torch.tensor([3, 3, 3, 3]),
        mask=mask,
        old_logprobs=old_lp,
        ref_logprobs=ref_lp,
        beta=0.1,
        score_moments=rl.RunningMoments(),
    )
    want_scores = shape_scores(cfg.ppo, 8, raw, ended, torch.tensor([3, 3, 3, 3]), rl.RunningMoments())
    want_kl = rl.kl_penalty(old_lp, ref_lp, cfg.ppo.kl_estimator) * mask
    want_rewards, want_non_score = rl.shaped_rewards(want_scores, want_kl, mask, 0.1)
    want_adv, want_ret = advantages_for(cfg.ppo, want_rewards, values, mask, loss_mask)
    for name, want in (("scores", want_scores), ("kl", want_kl), ("rewards", want_rewards)):
        assert torch.equal(getattr(got, name), want), name
    assert torch.equal(got.non_score, want_non_score) and torch.equal(got.loss_mask, loss_mask)
    assert torch.equal(got.advantages, want_adv) and torch.equal(got.returns, want_ret)


def test_a_reward_model_reading_text_gets_the_prompt_as_the_data_set_writes_it():
    """With a chat template the policy sees the templated prompt; the server's text-reading reward
    model gets the data set's own prompt (never the policy's template), and the decoded response."""
    from types import SimpleNamespace

    from aligner.actor.trainer import PPOTrainer
    from aligner.generation.engine import GenerationOutput
    from aligner.tokenizers import CharTokenizer

    tok = CharTokenizer()
    rows = [("12:", "12"), ("3:", "3")]  # templated prompt ("N:"), response
    seqs = [tok.encode(p) + tok.encode(r) + [tok.eos_id] for p, r in rows]
    tokens = torch.full((2, max(map(len, seqs))), tok.pad_id)
    for i, x in enumerate(seqs):
        tokens[i, : len(x)] = torch.tensor(x)
    gen = GenerationOutput(
        tokens=tokens,
        lengths=torch.tensor([len(x) for x in seqs]),
        prompt_lengths=torch.tensor([len(p) for p, _ in rows]),
        logprobs=torch.zeros(2, tokens.shape[1] - 1),
        ended=torch.tensor([True, True]),
    )
    trainer = SimpleNamespace(
        state=SimpleNamespace(tp_rank=0, pp_rank=0),
        critic=SimpleNamespace(needs_texts=True),
        tokenizer=tok,
        raw_prompts={"12:": "12"},  # "3:" was not templated: its decoded tokens stand
        engine=SimpleNamespace(stop_ids=tok.stop_ids),
        cfg=SimpleNamespace(generation=SimpleNamespace(stop_token_ids=[])),
    )
    out = PPOTrainer._reward_inputs(trainer, gen, ['{"a":1}', "{}"], ["12:", "3:"])
    assert out == {"extras": ['{"a":1}', "{}"], "prompt_texts": ["12", "3:"], "response_texts": ["12", "3"]}
    trainer.cfg.generation.stop_token_ids = [tok.encode("2")[0]]  # generation.stop_token_ids end texts too
    assert PPOTrainer._reward_inputs(trainer, gen, None, ["12:", "3:"])["response_texts"] == ["1", "3"]
    trainer.cfg.generation.stop_token_ids = []
    trainer.critic.needs_texts = False
    assert PPOTrainer._reward_inputs(trainer, gen, None, ["12:", "3:"]) == {"extras": None}
    trainer.state.tp_rank = 1  # only the replica's first rank sends
    assert PPOTrainer._reward_inputs(trainer, gen, None, ["12:", "3:"]) == {}


# -- log-probs over the action space ---------------------------------------------------------


def test_logprobs_leave_out_the_columns_no_action_lives_in():
    """The char tokenizer's pad id and the vocabulary padding are no actions: the training
    softmax runs over the sampled ids only, and a padding target reads 0."""
    cfg = ActorConfig()
    tok = CharTokenizer()
    lp = PolicyLogprobs.for_actor(cfg, ONE_RANK, tok)
    assert lp.actions == tok.sample_vocab_size and lp.pad_from == tok.sample_vocab_size
    v = cfg.model.padded_vocab_size(1)
    torch.manual_seed(0)
    logits = torch.randn(2, 5, v)
    tokens = torch.randint(0, lp.actions, (2, 5))
    tokens[1, 4] = tok.pad_id
    got = lp.sequence_logprobs(lp.masked(logits), tokens)
    want = torch.log_softmax(logits[:, :-1, : lp.actions] / cfg.generation.temperature, -1)
    want = want.gather(-1, tokens[:, 1:].clamp(max=lp.actions - 1).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1, :3], want[1, :3], atol=1e-6)
    assert got[1, 3] == 0.0


# -- the learning-rate schedule ---------------------------------------------------------------


def test_a_schedule_set_to_a_position_continues_as_one_that_stepped_there():
    def schedule():
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=1e-2)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(3, 20, 0.1))

    opt_a, stepped = schedule()
    for _ in range(7):
        opt_a.step()
        stepped.step()
    opt_b, placed = schedule()
    set_schedule_position(placed, opt_b, 7)
    assert placed.get_last_lr() == stepped.get_last_lr()
    opt_a.step(), stepped.step(), opt_b.step(), placed.step()
    assert placed.get_last_lr() == pytest.approx(stepped.get_last_lr())
    assert lr_lambda(3, 20, 0.1)(20) == pytest.approx(0.1)  # the end of the cosine: min_lr / lr


# -- a step's metrics and timers -------------------------------------------------------------


def test_timers_add_up_under_their_metric_names():
    timed = Timers()
    with timed("generate"):
        time.sleep(0.01)
    with timed("critic_wait"):
        pass
    with timed("generate"):
        time.sleep(0.01)
    assert list(timed.seconds) == ["timers/generate", "timers/critic_wait"]
    assert timed.seconds["timers/generate"] >= 0.02
    with pytest.raises(KeyError), timed("train"):
        raise KeyError("the part failed")
    assert "timers/train" in timed.seconds  # counted even when the part raised


def test_step_record_metrics_by_hand():
    """Two samples of prompt length 2: lengths 4 and 3 -> responses of 2 and 1 tokens."""
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    gen = GenerationOutput(
        tokens=torch.zeros(2, 4, dtype=torch.long),
        lengths=torch.tensor([4, 3]),
        prompt_lengths=torch.tensor([2, 2]),
        logprobs=torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]]),
        ended=torch.tensor([True, False]),
    )
    rec = StepRecord(
        gen=gen,
        mask=mask,
        scores=torch.tensor([1.0, 3.0]),
        kl=torch.tensor([[0.0, 0.1, 0.3], [0.0, 0.2, 0.0]]),
        non_score=torch.tensor([[0.0, -0.01, -0.03], [0.0, -0.02, 0.0]]),
        entropy=torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]]),
        old_logprobs=torch.tensor([[0.0, -1.25, -2.0], [0.0, -0.5, 0.0]]),
        values=torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 0.0]]),
        returns=torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 0.0]]),
        kl_coef=0.05,
        lr=1e-3,
        policy_stats={"loss/policy": 0.25, "policy/clipfrac": 0.5},
        critic_stats=TrainResult(loss=0.75, grad_norm=2.0, applied_step=3),
        timers={"timers/generate": 0.5, "timers/step": 1.0},
    )
    m = rec.metrics()
    assert m["objective/scores"] == pytest.approx(2.0)  # (1 + 3) / 2
    assert m["objective/kl"] == pytest.approx(0.3)  # (0.4 + 0.2) / 2 samples
    assert m["objective/non_score_reward"] == pytest.approx(-0.03)
    assert m["rollout/entropy"] == pytest.approx(2.0)  # (1 + 2 + 3) / 3 response tokens
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (1.5, 2.0, 1.0)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (2.0, 3.0, 1.0)
    # values and returns over the 3 response tokens (1, 2; 1); no advantages given
    assert m["critic/values/mean"] == pytest.approx(4 / 3) and m["critic/returns/max"] == 2.0
    assert "critic/advantages/mean" not in m and "train/episode" not in m
    assert m["rollout/ended_fraction"] == pytest.approx(0.5)
    assert m["rollout/logprob_mismatch_max"] == pytest.approx(0.25)
    assert m["rollout/logprob_mismatch_mean"] == pytest.approx(0.25 / 3)
    assert m["critic/vf_explained_var"] == pytest.approx(1.0)
    assert m["throughput/tokens_per_s"] == pytest.approx(3 / 0.5)
    assert (m["critic/vf_loss"], m["critic/grad_norm"], m["objective/kl_coef"], m["lr"]) == (
        0.75,
        2.0,
        0.05,
        1e-3,
    )
    assert m["critic/vf_clipfrac"] == 0.0
    for old in ("loss/value", "objective/entropy", "rollout/response_length", "critic/explained_variance"):
        assert old not in m
    assert {"loss/policy", "policy/clipfrac", "timers/generate", "timers/step"} <= m.keys()
    rec.critic_stats = None  # the first step: no critic update has finished yet
    assert "critic/vf_loss" not in rec.metrics()
