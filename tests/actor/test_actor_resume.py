"""Checkpoints and exact resume of a whole run, through a real critic server.

One server for the module: every run starts by resetting its critic to the step-0 checkpoint
(``checkpoint.save_initial``), so runs are independent. The reference is one continuous run;
every other run is stopped (SIGKILL from outside, or the process killing itself at a named point
of a save or of a step), resumed with ``checkpoint.resume=auto``, and must end with the same policy weights
and the same metrics at every step as the continuous run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aligner.checkpoint import complete_steps, read_json
from aligner.critic.launch import start_server
from aligner.metrics import read_metrics

pytestmark = [pytest.mark.server, pytest.mark.subprocess]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6

RUN = [
    "data.task=copy",
    "data.num_digits=3",
    "generation.max_new_tokens=4",
    "ppo.global_batch_size=64",
    "ppo.mini_batch_size=32",
    "ppo.micro_batch_size=32",
    "ppo.ppo_epochs=2",
    "ppo.normalize_scores=true",
    "ppo.adaptive_kl=true",
    "optim.min_lr=1e-4",  # a decaying schedule, so its position matters
    "validation.interval=2",
    "validation.before_train=true",
    "validation.num_prompts=16",
    "checkpoint.save_interval=2",
    "checkpoint.keep_last=2",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("critic")
    with start_server(
        [
            "server.grpc_port=0",
            "server.metrics_port=null",
            "model.max_seq_len=16",
            "optim.lr=1e-3",
            "reward.fn=aligner.tasks.digits:copy_reward",
            f"log.dir={d}",
            "checkpoint.keep_last=0",
            "checkpoint.save_on_sigterm=false",
            "log.tensorboard=false",
        ],
        log_path=d / "server.log",
    ) as s:
        s.critic_root = d / "checkpoints"
        yield s


def _cmd(server, run_dir: Path, *extra: str, nproc: int = 1) -> list[str]:
    from aligner.distributed import free_port

    launcher = (
        [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
        if nproc > 1
        else []
    )
    return [
        sys.executable,
        *launcher,
        str(ROOT / "examples" / "train_actor.py"),
        "+recipe=digits",
        f"critic.url={server.url}",
        f"logging.run_dir={run_dir}",
        f"ppo.num_steps={STEPS}",
        *RUN,
        *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _run(server, run_dir: Path, *extra: str, env: dict | None = None, ok: bool = True, nproc: int = 1):
    out = subprocess.run(
        _cmd(server, run_dir, *extra, nproc=nproc),
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
    )
    if ok:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(
        str(run_dir / "checkpoints" / f"step_{step:08d}" / "actor" / "policy" / "model.safetensors")
    )


def _same_run(a: Path, b: Path, steps: int = STEPS) -> None:
    wa, wb = _weights(a, steps), _weights(b, steps)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= 1e-6, worst
    ra, rb = read_metrics(str(a / "metrics.jsonl")), read_metrics(str(b / "metrics.jsonl"))
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(0, steps + 1))

    def compared(row: dict) -> set[str]:
        # Costs, not training quantities: a resumed run refits its engine once more than the
        # uninterrupted one (after loading), so the refit's bytes differ at the step after it;
        # memory and speed (perf/*) are measured, not computed.
        # A run on rollout workers logs their side (rollout/*, push/*) besides.
        costs = ("timers/", "refit/", "perf/", "rollout/", "push/")
        return {k for k in row if not k.startswith(costs) and k not in ("time", "throughput/tokens_per_s")}

    for x, y in zip(ra, rb):
        keys = compared(x)
        assert keys == compared(y)
        for k in keys:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (x["step"], k, x[k], y[k])


@pytest.fixture(scope="module")
def continuous(server, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("continuous")
    out = _run(server, run_dir, "checkpoint.save_interval=0")
    assert "starting fresh" in out.stdout
    return run_dir


def test_continuous_run_saves_validates_and_keeps_the_best(continuous):
    ckpt = continuous / "checkpoints"
    assert complete_steps(ckpt, role="actor")[-1] == STEPS
    state = read_json(ckpt / f"step_{STEPS:08d}" / "actor" / "trainer_state.json")
    assert state["trainer"]["step"] == STEPS
    assert state["config"]["ppo"]["num_steps"] == STEPS  # the config it was made with
    rows = read_metrics(str(continuous / "metrics.jsonl"))
    vals = {r["step"]: r["validation/scores"] for r in rows if "validation/scores" in r}
    assert sorted(vals) == [0, 2, 4, 6]
    for r in rows:
        if "validation/scores" in r:
            assert {"validation/kl", "validation/response_length"} <= r.keys()
    best = read_json(ckpt / "best.json")
    best_step = max((s for s in vals if s > 0), key=lambda s: (vals[s], -s))
    assert best["step"] == best_step and best["validation/scores"] == pytest.approx(vals[best_step])
    assert (ckpt / "best").resolve() == (ckpt / f"step_{best_step:08d}").resolve()
    samples = (continuous / "val_samples.jsonl").read_text().splitlines()
    assert len(samples) == 4 * 4  # 4 validations x num_samples


@pytest.mark.faults  # the actor's kill points belong to the fault suite (make faults)
@pytest.mark.parametrize(
    "fault",
    [
        "mid_step@3",
        "before_critic_save@4",
        "after_critic_save@4",
        "mid_actor_write@4",
        "before_commit@4",
        "after_commit@4",
    ],
)
def test_killed_at_a_fault_point_resumes_exactly(server, continuous, tmp_path, fault):
    """Killed mid-step (generated, its critic update not sent) or at a point of a save."""
    run_dir = tmp_path / "run"
    out = _run(server, run_dir, env=_env(ALIGNER_FAULT_AT=fault), ok=False)
    assert out.returncode == -signal.SIGKILL, out.stdout[-2000:] + out.stderr[-2000:]
    if fault.startswith("mid_step"):  # step 2 was logged, step 3 was not
        assert [r["step"] for r in read_metrics(str(run_dir / "metrics.jsonl"))] == [0, 1, 2]
    expect = 4 if fault.startswith("after_commit") else 2
    assert complete_steps(run_dir / "checkpoints", role="actor")[-1] == expect
    out = _run(server, run_dir)
    assert f"resuming from step {expect}" in out.stdout, out.stdout[-2000:]
    _same_run(continuous, run_dir)


@pytest.mark.faults
def test_a_killed_trainer_stops_its_rollout_worker_and_resumes_exactly_with_a_new_one(
    server, continuous, tmp_path
):
    """The trainer generates on a worker of its own (k = 0: the continuous run's algorithm) and is
    killed mid-step 3; the worker sees it go and exits 1 (nothing left waiting); a new trainer and
    a new worker resume from step 2 and end as the continuous run."""
    from aligner.distributed import spare_port

    run_dir = tmp_path / "run"

    def with_worker(env: dict) -> tuple[subprocess.CompletedProcess, int, str]:
        address = f"127.0.0.1:{spare_port()}"
        rollout = ["rollout.workers=1", f"rollout.address={address}", "rollout.timeout_s=120"]
        log = tmp_path / f"worker-{address.rsplit(':', 1)[1]}.log"
        with open(log, "w") as f:
            worker = subprocess.Popen(
                [sys.executable, "-m", "aligner.rollout.worker", "+recipe=digits", *RUN, *rollout],
                env=_env(),
                cwd=str(tmp_path),
                stdout=f,
                stderr=subprocess.STDOUT,
            )
            try:
                out = _run(server, run_dir, *rollout, env=env, ok=False)
                code = worker.wait(timeout=60)
            finally:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        return out, code, log.read_text()

    out, code, worker_log = with_worker(_env(ALIGNER_FAULT_AT="mid_step@3"))
    assert out.returncode == -signal.SIGKILL, out.stdout[-2000:] + out.stderr[-2000:]
    assert code == 1 and "stopping:" in worker_log, worker_log[-2000:]
    assert complete_steps(run_dir / "checkpoints", role="actor")[-1] == 2
    out, code, worker_log = with_worker(_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert code == 0 and "resuming from step 2" in out.stdout
    _same_run(continuous, run_dir)


def test_sigkill_from_outside_mid_training_resumes_exactly(server, continuous, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(server, run_dir), env=_env(), cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and any('"step": 3' in line for line in metrics.read_text().splitlines()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps = complete_steps(run_dir / "checkpoints", role="actor")
    assert steps and steps[-1] < STEPS, steps
    out = _run(server, run_dir)
    assert f"resuming from step {steps[-1]}" in out.stdout
    _same_run(continuous, run_dir)


def test_resume_refuses_a_changed_model_and_allows_a_changed_lr(server, continuous, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(continuous / "checkpoints", run_dir / "checkpoints", symlinks=True)
    out = _run(server, run_dir, "model.hidden_size=32", ok=False)
    assert out.returncode != 0
    assert "cannot resume" in out.stderr and "hidden_size" in out.stderr, out.stderr[-2000:]
    # A larger step budget with another learning rate continues from the saved step when asked to
    # (checkpoint.resume=auto refuses another config: tests/actor/test_run_fingerprint.py).
    out = _run(
        server,
        run_dir,
        f"ppo.num_steps={STEPS + 1}",
        "optim.lr=5e-4",
        "optim.min_lr=5e-5",
        "checkpoint.resume=force",
    )
    assert f"resuming from step {STEPS}" in out.stdout and "optim.lr: 0.002 -> 0.0005" in out.stdout
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    assert rows[-1]["step"] == STEPS + 1


def test_resume_checks_random_states_and_leaves_out_device_ones(server, continuous, tmp_path):
    """Random states are checked before a resume applies anything. A shard missing one fails
    the resume, naming it. A checkpoint whose device states do not fit this process (a GPU
    run's: CUDA's generator, and a tracker state of CUDA's size) resumes on a CPU with a
    warning naming them, restoring the portable states."""
    import shutil

    from aligner.checkpoint import load_tensors, save_tensors

    run_dir = tmp_path / "run"
    shutil.copytree(continuous / "checkpoints", run_dir / "checkpoints", symlinks=True)
    rng_file = run_dir / "checkpoints" / f"step_{STEPS:08d}" / "actor" / "rng_tp00_pp00_dp000.safetensors"
    saved = load_tensors(rng_file)
    tracker = [k for k in saved if k.startswith("tracker.")]
    assert tracker and "torch_cuda" not in saved
    save_tensors(rng_file, {k: v for k, v in saved.items() if k != "numpy_pos"})
    out = _run(server, run_dir, f"ppo.num_steps={STEPS + 1}", ok=False)
    assert out.returncode != 0
    assert "cannot resume" in out.stderr and "RNG states ['numpy_pos']" in out.stderr, out.stderr[-2000:]
    cuda_sized = torch.zeros(16, dtype=torch.uint8)  # torch.cuda.get_rng_state()'s size
    save_tensors(rng_file, {**saved, "torch_cuda": cuda_sized, **{k: cuda_sized for k in tracker}})
    out = _run(server, run_dir, f"ppo.num_steps={STEPS + 1}")
    assert f"resuming from step {STEPS}" in out.stdout
    assert "device RNG states do not fit this process" in out.stderr, out.stderr[-2000:]
    assert "torch_cuda [16] here absent" in out.stderr
    assert f"{tracker[0]} [16] here [{saved[tracker[0]].numel()}]" in out.stderr
    assert read_metrics(str(run_dir / "metrics.jsonl"))[-1]["step"] == STEPS + 1


def test_fresh_start_refuses_a_root_with_checkpoints(server, continuous, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(continuous / "checkpoints", run_dir / "checkpoints", symlinks=True)
    out = _run(server, run_dir, "checkpoint.resume=none", ok=False)
    assert out.returncode != 0 and "checkpoint.resume=none" in out.stderr, out.stderr[-2000:]


LAYOUTS = {
    "tp2": (["parallel.tensor_model_parallel_size=2"], ["optim_tp00_pp00", "optim_tp01_pp00"]),
    # The data-parallel ranks hold the same optimizer state: one shard.
    "dp2": (["ppo.micro_batch_size=16"], ["optim_tp00_pp00"]),
    "pp2": (["parallel.pipeline_model_parallel_size=2"], ["optim_tp00_pp00", "optim_tp00_pp01"]),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_rank_run_resumes_exactly(server, tmp_path, layout):
    """Two processes (TP=2, DP=2 or PP=2): each rank's optimizer shard and RNG come back; killed
    while the ranks write their files, the run resumes from the previous step and ends as the
    uninterrupted run of the same layout."""
    extra, shards = LAYOUTS[layout]
    args = [*extra, "ppo.num_steps=4"]
    _run(server, tmp_path / "continuous", *args, "checkpoint.save_interval=0", nproc=2)
    run_dir = tmp_path / "run"
    out = _run(server, run_dir, *args, env=_env(ALIGNER_FAULT_AT="mid_actor_write@4"), ok=False, nproc=2)
    assert out.returncode != 0
    assert complete_steps(run_dir / "checkpoints", role="actor")[-1] == 2
    step2 = run_dir / "checkpoints" / "step_00000002" / "actor"
    assert sorted(p.name for p in step2.glob("optim_tp*.safetensors")) == [f"{s}.safetensors" for s in shards]
    out = _run(server, run_dir, *args, nproc=2)
    assert "resuming from step 2" in out.stdout, out.stdout[-2000:]
    _same_run(tmp_path / "continuous", run_dir, steps=4)
    if layout == "dp2":
        # The data-parallel ranks' optimizer state is one: a DP=2 checkpoint goes on at DP=1
        # (its per-rank random states are left out, and the log says why not exactly).
        out = _run(server, run_dir, *extra, "ppo.num_steps=5")
        assert "resuming from step 4" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
        assert "(DP=2), this run has 1 (DP=1): random states are not restored" in out.stdout
        assert read_metrics(str(run_dir / "metrics.jsonl"))[-1]["step"] == 5
    if layout == "pp2":
        # The optimizer state is cut by stage: another pipeline size is refused, naming both, even
        # with checkpoint.resume=force (which passes over the config's other differences).
        out = _run(server, run_dir, "ppo.num_steps=5", "checkpoint.resume=force", ok=False)
        assert out.returncode != 0
        assert "pipeline_model_parallel_size" in out.stderr and "2 stage(s)" in out.stderr, out.stderr[-2000:]


@pytest.mark.multiprocess
def test_a_one_rank_checkpoint_goes_on_at_two_data_parallel_ranks(server, continuous, tmp_path):
    """The optimizer state is the same on every data-parallel rank, so a DP=1 checkpoint goes on
    at DP=2 (where the global batch divides), without the random states of a layout it never had."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(continuous / "checkpoints", run_dir / "checkpoints", symlinks=True)
    out = _run(server, run_dir, f"ppo.num_steps={STEPS + 1}", "ppo.micro_batch_size=16", nproc=2)
    # The newest step both roles hold: the module's server may have moved on since the fixture.
    assert re.search(r"resuming from step \d+", out.stdout), out.stdout[-2000:]
    assert "(DP=1), this run has 2 (DP=2): random states are not restored" in out.stdout
    assert read_metrics(str(run_dir / "metrics.jsonl"))[-1]["step"] == STEPS + 1


def test_any_checkpoint_exports_to_hugging_face(continuous, tmp_path):
    """On demand: a step's policy folder goes through aligner-convert to a folder transformers
    loads, with the same next-token logits as our checkpoint."""
    from transformers import AutoModelForCausalLM

    from aligner.models.convert_cli import main as convert

    policy = continuous / "checkpoints" / f"step_{STEPS:08d}" / "actor" / "policy"
    assert convert(["export", str(policy), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    w = _weights(continuous, STEPS)
    assert torch.equal(hf.model.embed_tokens.weight.detach(), w["embedding.word_embeddings.weight"])
    with torch.no_grad():
        out = hf.generate(torch.tensor([[1, 2, 3, 11]]), max_new_tokens=3, do_sample=False, pad_token_id=13)
    assert out.shape == (1, 7)
