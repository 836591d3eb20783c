"""The actor's pieces on their own, on one process without a server: the critic handle the
client satisfies, the link that sends to it, the prompt order and its groups, log-probs over the
action space, the LR schedule's resume position, a step's metrics and timers, and the config
checks both roles share (the estimators' among them)."""

from __future__ import annotations

import inspect
import math
import random
import time
from concurrent.futures import Future

import pytest
import torch

from aligner.actor.config import ActorConfig, PolicyOptimConfig, validate_actor_config
from aligner.actor.critic_link import CriticLink
from aligner.actor.logprobs import PolicyLogprobs
from aligner.actor.optimizer import lr_lambda, set_schedule_position
from aligner.actor.prompts import PromptSampler
from aligner.actor.rollout import StepRecord
from aligner.config_checks import ConfigError, Problems
from aligner.critic.config import CriticOptimConfig, build_config
from aligner.distributed import ParallelState
from aligner.generation.config import GenerationConfig
from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.metrics import Timers
from aligner.optim import OptimConfig
from aligner.tokenizers import CharTokenizer
from aligner.wire.client import RemoteCriticClient
from aligner.wire.handle import CriticHandle
from aligner.wire.protocol import TrainResult

ONE_RANK = ParallelState(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu"), None, None, None)

# -- the critic handle ---------------------------------------------------------------------------


def _protocol_methods() -> list[str]:
    return [n for n, v in vars(CriticHandle).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_the_client_has_every_call_of_the_handle_with_its_signature():
    names = _protocol_methods()
    assert {"infer", "train", "save", "load", "server_info", "check_compatible", "close"} <= set(names)
    for name in names:
        want = inspect.signature(getattr(CriticHandle, name))
        got = inspect.signature(getattr(RemoteCriticClient, name))
        assert [(p.name, p.kind) for p in got.parameters.values()] == [
            (p.name, p.kind) for p in want.parameters.values()
        ], name


class FakeCritic:
    """Answers at once: values t / 10 at position t, reward = the row's length."""

    url = "fake://critic"

    def __init__(self) -> None:
        self.trained: list[int] = []

    def server_info(self):
        raise NotImplementedError

    def check_compatible(self, vocab_size, max_seq_len, tokenizer_fingerprint):
        return None

    def infer(self, tokens, lengths, prompt_lengths, step=None):
        b, s = tokens.shape
        f: Future = Future()
        f.set_result((torch.arange(s - 1).float().repeat(b, 1).numpy() / 10, lengths.float().numpy()))
        return f

    def train(self, tokens, lengths, returns, old_values, mask, step):
        self.trained.append(step)
        f: Future = Future()
        f.set_result(TrainResult(loss=0.5, grad_norm=1.5, applied_step=step))
        return f

    def save(self, step):
        return None

    def load(self, step):
        return None

    def close(self):
        return None


class InferOnly:
    url = "fake://critic"

    def infer(self, tokens, lengths, prompt_lengths):
        raise NotImplementedError


def test_a_client_is_a_critic_handle_and_an_incomplete_object_is_not():
    client = object.__new__(RemoteCriticClient)  # no server needed: the structure is what counts
    client.url = "grpc://127.0.0.1:1"
    assert isinstance(client, CriticHandle)
    assert isinstance(FakeCritic(), CriticHandle)
    assert not isinstance(InferOnly(), CriticHandle)


def test_the_link_sends_keeps_the_update_in_flight_and_reports_its_result_once():
    critic = FakeCritic()
    link = CriticLink(critic, ONE_RANK, pad_id=13)
    tokens, lengths = torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 4])
    values, scores = link.result(link.infer(tokens, lengths, torch.tensor([2, 2]), 7), tokens.shape)
    assert values.shape == (2, 4) and values.dtype == torch.float32
    assert values[1].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3]) and scores.tolist() == [5.0, 4.0]
    per_token = torch.zeros(2, 4)
    assert link.train(tokens, lengths, per_token, per_token, per_token, 7) is link.pending is not None
    with pytest.raises(RuntimeError, match="in flight"):
        link.train(tokens, lengths, per_token, per_token, per_token, 8)
    link.wait()
    assert link.pending is None and critic.trained == [7]
    assert link.take_completed() == TrainResult(loss=0.5, grad_norm=1.5, applied_step=7)
    assert link.take_completed() is None


def test_a_restart_known_when_sending_is_raised_where_the_link_waits():
    """A request the client refuses at once (a restart it found earlier) fails where the
    step waits for it, as one that failed on the server does; the link then holds nothing."""
    from aligner.wire.errors import CriticRestartedError

    class Restarted(FakeCritic):
        def infer(self, *args):
            raise CriticRestartedError(self.url, None, 3, call="critic_infer", reason="found earlier")

        train = infer

    link = CriticLink(Restarted(), ONE_RANK, pad_id=13)
    tokens, lengths, per_token = torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 4]), torch.zeros(2, 4)
    future = link.infer(tokens, lengths, torch.tensor([2, 2]), 4)
    with pytest.raises(CriticRestartedError, match="found earlier"):
        link.result(future, tokens.shape)
    link.completed = {"loss": 1.0}
    link.train(tokens, lengths, per_token, per_token, per_token, 4)
    with pytest.raises(CriticRestartedError, match="expected critic step 3"):
        link.wait()
    assert link.pending is None and link.completed == {"loss": 1.0}
    link.drop()
    assert link.take_completed() is None


def test_a_critic_future_times_out_naming_call_step_and_address_and_keeps_the_requests_own_error():
    from aligner.wire.errors import CriticTimeoutError
    from aligner.wire.transport import CriticFuture, run_into

    f = CriticFuture("critic_train", "grpc://10.0.0.1:8001", 0.05, step=7)
    t0 = time.monotonic()
    with pytest.raises(CriticTimeoutError) as e:
        f.result()
    assert 0.05 <= time.monotonic() - t0 < 2
    assert str(e.value).startswith("critic_train of step 7 to the critic server at grpc://10.0.0.1:8001: ")
    own = CriticTimeoutError("critic_train", "grpc://10.0.0.1:8001", 600.0, step=7, what="the request's")
    run_into(f, lambda: (_ for _ in ()).throw(own))
    with pytest.raises(CriticTimeoutError) as e:
        f.result()
    assert e.value is own
    done = CriticFuture("critic_infer", "grpc://10.0.0.1:8001", 0.05)
    run_into(done, lambda x: x + 1, 1)
    assert done.result() == 2


def test_a_restarted_error_crosses_to_other_ranks_as_json():
    from aligner.wire.errors import CriticRestartedError
    from aligner.wire.protocol import ServerInfo

    info = ServerInfo(2, 14, 32, "char", "fp", 3, 64, 64, checkpoint_steps=[0, 2], instance_id="ab12")
    e = CriticRestartedError("grpc://h:1", info, 5, call="critic_train", reason="fenced")
    back = CriticRestartedError.from_json(e.to_json())
    assert (back.critic_step, back.expected_step, back.checkpoint_steps, back.instance_id) == (
        3,
        5,
        [0, 2],
        "ab12",
    )
    assert str(back) == str(e)
    assert "it holds critic step 3" in str(e) and "the actor expected critic step 5" in str(e)
    assert CriticRestartedError("u", None, None, call="c", reason="r").critic_step is None


def test_generation_engine_and_layout_are_checked_against_the_parallel_layout():
    def problems(**over):
        cfg = ActorConfig()
        for key, value in over.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return "\n".join(cfg.problems())

    assert "generation.engine='vllm': expected one of ['native', 'trtllm']" in problems(
        generation__engine="vllm"
    )
    msg = problems(generation__engine="trtllm", parallel__pipeline_model_parallel_size=2)
    assert "generation.engine='trtllm': expected 'native' with parallel.pipeline_model_parallel_size=2" in msg
    msg = problems(generation__engine="trtllm", generation__dtype="bf16")
    assert "generation.dtype='bf16': expected null with generation.engine=trtllm" in msg
    msg = problems(generation__engine="trtllm", generation__tensor_parallel_size=2)
    assert "generation.tensor_parallel_size=2: expected null or 1 with generation.engine=trtllm" in msg
    msg = problems(generation__tensor_parallel_size=3, parallel__tensor_model_parallel_size=2)
    assert "generation.tensor_parallel_size=3" in msg
    # The TensorRT-LLM engine's own settings are checked only when it is chosen.
    bad = ActorConfig()
    bad.generation.trtllm.bucket_mb = -1
    assert not any("trtllm" in m for m in bad.problems())
    bad.generation.engine = "trtllm"
    assert any(m.startswith("generation.trtllm.bucket_mb=-1") for m in bad.problems())


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
    """PPOTrainer's step 5 on its own (the methods read only the config, the score normaliser
    and the data-parallel group): the soft overlong penalty beside the missing-EOS one, and each
    estimator on the KL-shaped rewards, over the loss mask overlong filtering leaves."""
    from types import SimpleNamespace

    from aligner import rl
    from aligner.actor.trainer import PPOTrainer

    cfg = ActorConfig()
    cfg.generation.max_new_tokens = 8
    cfg.ppo.missing_eos_penalty, cfg.ppo.overlong_buffer, cfg.ppo.overlong_penalty = -1.0, 4, 2.0
    trainer = SimpleNamespace(cfg=cfg, score_moments=rl.RunningMoments(), _dp_group=None)
    shaped = PPOTrainer._shape_scores(
        trainer,
        torch.tensor([1.0, 1.0, 1.0, 1.0]),
        torch.tensor([True, True, False, True]),
        torch.tensor([3, 6, 8, 4]),
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
        got, _ = PPOTrainer._advantages(trainer, rewards, values, mask, loss_mask, scores)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=adv)
        assert not got[3].any() or adv == "gae"  # the filtered row has no advantage (GAE: no loss)
    cfg.ppo.grpo_std_norm, cfg.ppo.advantage = False, "grpo"
    got, _ = PPOTrainer._advantages(trainer, rewards, values, mask, loss_mask, scores)
    torch.testing.assert_close(got, rl.grpo_advantages(sequence, loss_mask, 2, std_norm=False))


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
    assert m["objective/entropy"] == pytest.approx(2.0)  # (1 + 2 + 3) / 3 response tokens
    assert m["rollout/response_length"] == pytest.approx(1.5)
    assert m["rollout/ended_fraction"] == pytest.approx(0.5)
    assert m["rollout/logprob_mismatch_max"] == pytest.approx(0.25)
    assert m["rollout/logprob_mismatch_mean"] == pytest.approx(0.25 / 3)
    assert m["critic/explained_variance"] == pytest.approx(1.0)
    assert m["throughput/tokens_per_s"] == pytest.approx(3 / 0.5)
    assert (m["loss/value"], m["critic/grad_norm"], m["objective/kl_coef"], m["lr"]) == (
        0.75,
        2.0,
        0.05,
        1e-3,
    )
    assert {"loss/policy", "policy/clipfrac", "timers/generate", "timers/step"} <= m.keys()
    rec.critic_stats = None  # the first step: no critic update has finished yet
    assert "loss/value" not in rec.metrics()


# -- configs -----------------------------------------------------------------------------------


def test_problems_name_key_value_and_expectation_and_are_raised_together():
    class Section:
        a, b, c = 0, True, 3

    p = Problems()
    p.positive_ints(Section, "s", ("a", "b", "c"))
    p.expect(False, "s.d", "x", "one of ['y']")
    assert p == [
        "s.a=0: expected a positive integer",
        "s.b=True: expected a positive integer",
        "s.d='x': expected one of ['y']",
    ]
    with pytest.raises(ConfigError) as e:
        p.raise_if_any("thing", ConfigError)
    assert str(e.value).startswith("invalid thing (3 problem(s)):\n  s.a=0")
    Problems().raise_if_any("thing")  # nothing to report


def test_both_roles_optim_sections_are_the_one_optim_config():
    for cls in (PolicyOptimConfig, CriticOptimConfig):
        assert issubclass(cls, OptimConfig)
        assert {f for f in OptimConfig.__dataclass_fields__} <= set(cls.__dataclass_fields__)
    assert PolicyOptimConfig().lr == 1e-3 and CriticOptimConfig().lr == 1e-5  # each role's default
    bad = {"adam_beta1": 1.0, "grad_clip": -1.0, "weight_decay": -0.1}
    want = ["optim.adam_beta1=1.0", "optim.grad_clip=-1.0", "optim.weight_decay=-0.1"]
    for cls in (PolicyOptimConfig, CriticOptimConfig):
        msgs = cls(**bad).problems()
        assert all(any(m.startswith(w) for m in msgs) for w in want), msgs
        for off in (None, 0.0):  # null and 0 both turn clipping off, in both roles
            assert cls(grad_clip=off).problems() == []
    assert OptimConfig(lr=2e-3, adam_beta1=0.8).adamw() == {
        "lr": 2e-3,
        "betas": (0.8, 0.999),
        "eps": 1e-5,
        "weight_decay": 0.0,
    }


def test_actor_and_critic_configs_report_their_optim_problems_the_same_way():
    cfg = ActorConfig()
    cfg.optim.adam_eps = 0.0
    cfg.generation.top_p = 2.0
    with pytest.raises(ConfigError) as actor:
        validate_actor_config(cfg, vocab_size=14)
    with pytest.raises(ConfigError) as critic:
        build_config({"optim": {"adam_eps": 0.0}})
    for e in (actor, critic):
        assert "optim.adam_eps=0.0: expected > 0" in str(e.value)
    assert "generation.top_p=2.0: expected a number in (0, 1]" in str(actor.value)


def test_actor_config_reports_bad_values_and_batch_divisibility_together():
    cfg = ActorConfig()
    assert cfg.problems(world_size=1, vocab_size=14) == []
    cfg.ppo.kl_estimator, cfg.ppo.global_batch_size, cfg.ppo.mini_batch_size = "k9", 100, 64
    assert cfg.problems(world_size=1, vocab_size=14) == [
        "ppo.kl_estimator='k9': expected 'k1', 'abs' or 'k3'",
        "ppo.global_batch_size (100) must be divisible by ppo.mini_batch_size (64)",
    ]
    cfg.ppo.mini_batch_size = 0  # an invalid size is reported as such, not divided by
    assert cfg.problems(world_size=1, vocab_size=14) == [
        "ppo.mini_batch_size=0: expected a positive integer",
        "ppo.kl_estimator='k9': expected 'k1', 'abs' or 'k3'",
    ]


def test_estimator_settings_are_checked_with_key_value_and_expectation():
    cfg = ActorConfig()
    p = cfg.ppo
    p.advantage, p.samples_per_prompt, p.critic_warmup_steps = "grpo", 1, 3
    p.overlong_buffer, p.overlong_penalty, p.max_generation_rounds = 9, -1.0, 0
    assert cfg.problems(world_size=1, vocab_size=14) == [
        "ppo.samples_per_prompt=1: expected >= 2 with ppo.advantage='grpo' (it compares the samples of one prompt)",
        "ppo.max_generation_rounds=0: expected a positive integer",
        "ppo.critic_warmup_steps=3: expected 0 with ppo.advantage='grpo' (only 'gae' has a critic to warm up)",
        "ppo.overlong_buffer=9: expected at most generation.max_new_tokens=8 (0 turns the penalty off)",
        "ppo.overlong_penalty=-1.0: expected a finite number >= 0",
    ]
    cfg = ActorConfig()
    p = cfg.ppo
    p.advantage, p.samples_per_prompt = "ppo", 3
    p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 48, 16, 8
    assert cfg.problems(world_size=2, vocab_size=14) == [
        "ppo.advantage='ppo': expected one of ['gae', 'grpo', 'rloo', 'reinforce_pp']",
        "ppo.mini_batch_size per data-parallel rank (8) must be divisible by ppo.samples_per_prompt (3): "
        "each rank's minibatches hold whole groups",
    ]
    cfg.ppo.dynamic_sampling = True
    assert (
        "ppo.dynamic_sampling=True: expected false with ppo.advantage='ppo' (it drops groups of equal scores: "
        "'grpo' or 'rloo' only)" in cfg.problems(world_size=2, vocab_size=14)
    )
    cfg.ppo.dynamic_sampling = False
    # 6 samples in groups of 2 over 2 ranks: 3 samples a rank, a group would straddle two ranks
    p.advantage, p.samples_per_prompt = "grpo", 2
    p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 6, 6, 3
    assert cfg.problems(world_size=2, vocab_size=14) == [
        "ppo.global_batch_size per data-parallel rank (3) must be divisible by ppo.samples_per_prompt (2): each "
        "rank generates whole groups of one prompt's samples",
        "ppo.mini_batch_size per data-parallel rank (3) must be divisible by ppo.samples_per_prompt (2): "
        "each rank's minibatches hold whole groups",
    ]
    ok = ActorConfig()
    ok.ppo.advantage, ok.ppo.samples_per_prompt = "rloo", 4
    ok.ppo.global_batch_size, ok.ppo.mini_batch_size, ok.ppo.micro_batch_size = 64, 32, 16
    assert ok.problems(world_size=2, vocab_size=14) == []
    ok.ppo.samples_per_prompt = 32  # 64 samples over 2 ranks: 32 each, one group per rank...
    assert ok.problems(world_size=2, vocab_size=14) == [  # ...but minibatches of 16 a rank would split it
        "ppo.mini_batch_size per data-parallel rank (16) must be divisible by ppo.samples_per_prompt (32): "
        "each rank's minibatches hold whole groups"
    ]
    ok.ppo.mini_batch_size = 64
    assert ok.problems(world_size=2, vocab_size=14) == []
    ok.ppo.samples_per_prompt = 64  # a group cannot span two ranks
    assert ok.problems(world_size=2, vocab_size=14) == [
        "ppo.global_batch_size per data-parallel rank (32) must be divisible by ppo.samples_per_prompt (64): each "
        "rank generates whole groups of one prompt's samples",
        "ppo.mini_batch_size per data-parallel rank (32) must be divisible by ppo.samples_per_prompt (64): "
        "each rank's minibatches hold whole groups",
    ]


def test_gae_refuses_a_reward_only_server_and_checkpoints_keep_their_estimator():
    from aligner.actor.checkpointing import config_differences
    from aligner.actor.critic_link import server_mode_problem
    from aligner.wire.protocol import ServerInfo

    info = ServerInfo(1, 14, 32, "char", "f", -1, 8, 8)
    assert info.critic  # a server older than the field holds a critic
    for adv in ("gae", "grpo", "rloo", "reinforce_pp"):
        assert server_mode_problem(adv, info, "grpc://x:1") is None
    info.critic = False
    assert server_mode_problem("grpo", info, "grpc://x:1") is None
    assert server_mode_problem("gae", info, "grpc://x:1").startswith(
        "ppo.advantage='gae' needs the critic's values and trains the critic, but the server at grpc://x:1 "
        "runs mode=reward_only"
    )
    cfg, tok = ActorConfig(), CharTokenizer()
    saved = {
        "model_config": cfg.model.to_dict(),
        "tokenizer": "char",
        "tokenizer_fingerprint": tok.fingerprint(),
        "tensor_model_parallel_size": 1,
        "precision": "fp32",
        "config": {"ppo": {"advantage": "grpo"}},
    }
    assert config_differences(saved, cfg, ONE_RANK, tok, "fp32") == [
        "ppo.advantage: the checkpoint was made by a run without a critic (ppo.advantage='grpo'), this run is "
        "one with a critic (ppo.advantage='gae'); resume with ppo.advantage='grpo', or start fresh"
    ]
    cfg.ppo.advantage = "rloo"  # another critic-free estimator resumes
    assert config_differences(saved, cfg, ONE_RANK, tok, "fp32") == []
    del saved["config"]  # a checkpoint older than the key was made with a critic
    assert (
        "ppo.advantage: the checkpoint was made by a run with a critic"
        in config_differences(saved, cfg, ONE_RANK, tok, "fp32")[0]
    )


def test_critic_section_reports_bad_waits_restart_policy_and_token_file(tmp_path):
    cfg = ActorConfig()
    cfg.critic.wait_timeout_s, cfg.critic.on_restart, cfg.critic.max_restarts = 0.0, "retry", -1
    cfg.critic.run_token_file = str(tmp_path / "absent")
    problems = cfg.problems(world_size=1, vocab_size=14)
    assert problems == [
        "critic.wait_timeout_s=0.0: expected a finite number of seconds > 0",
        "critic.max_restarts=-1: expected an integer >= 0",
        "critic.on_restart='retry': expected one of ['resume', 'fail']",
        f"critic.run_token_file='{tmp_path / 'absent'}': expected an existing file (or null: "
        "$ALIGNER_RUN_TOKEN, else no token)",
    ]
    defaults = ActorConfig().critic
    assert (defaults.on_restart, defaults.max_restarts, defaults.wait_timeout_s) == ("resume", 3, 600.0)


def test_generation_config_builds_the_engines_sampling_params():
    g = GenerationConfig(max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, stop_strings=["9"])
    sp = g.sampling(seed=11)
    assert sp == SamplingParams(
        max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, stop_strings=("9",), seed=11
    )
    assert g.sampling(greedy=True, seed=0).greedy
    # Every setting the two share by name is carried over, and nothing else is shared by accident.
    shared = set(GenerationConfig.__dataclass_fields__) & set(SamplingParams.__dataclass_fields__)
    assert shared == {"max_new_tokens", "temperature", "top_k", "top_p", "stop_strings"}
    assert GenerationConfig(temperature=math.nan, num_threads=0).problems() == [
        "generation.temperature=nan: expected a finite number > 0",
        "generation.num_threads=0: expected an integer >= 1 or null",
    ]


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
    )
    out = PPOTrainer._reward_inputs(trainer, gen, ['{"a":1}', "{}"], ["12:", "3:"])
    assert out == {"extras": ['{"a":1}', "{}"], "prompt_texts": ["12", "3:"], "response_texts": ["12", "3"]}
    trainer.critic.needs_texts = False
    assert PPOTrainer._reward_inputs(trainer, gen, None, ["12:", "3:"]) == {"extras": None}
    trainer.state.tp_rank = 1  # only the replica's first rank sends
    assert PPOTrainer._reward_inputs(trainer, gen, None, ["12:", "3:"]) == {}
