"""What the actor's end-to-end tests share: a digit-task server on free loopback ports, the
actor's entry point run in this process (composed as its command line would be) or under
torchrun, and the checks of what a run produced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aligner.actor.run import run
from aligner.critic.launch import ServerProcess, start_server
from aligner.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

# Small and fast: 3-digit tasks, the demo's model and learning rate.
FAST = [
    "data.num_digits=3",
    "generation.max_new_tokens=4",
    "ppo.global_batch_size=256",
    "ppo.mini_batch_size=64",
    "ppo.micro_batch_size=64",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


def digit_server(tmp_path: Path, task: str, *extra: str) -> ServerProcess:
    """A critic server scoring the built-in ``task`` (``copy``, ``reverse``, ``sort``)."""
    return start_server(
        [
            "server.grpc_port=0",
            "server.metrics_port=null",
            "model.max_seq_len=16",
            "optim.lr=1e-3",
            f"reward.fn=aligner.tasks.digits:{task}_reward",
            f"log.dir={tmp_path / 'critic'}",
            "checkpoint.save_on_sigterm=false",
            "log.tensorboard=false",
            *extra,
        ],
        log_path=tmp_path / "server.log",
    )


def run_actor(
    url: str, run_dir: Path, overrides: list[str], *, scored_only: bool = True, preset: str | None = "digits"
) -> list[dict]:
    """:func:`aligner.actor.run.run` in this process on ``actor.yaml`` with ``preset`` (a recipe's
    name, or None for the packaged defaults) and ``overrides``; the rows of its metrics.jsonl
    (only the training steps' with ``scored_only``)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
        dcfg = compose(
            "actor",
            overrides=[
                *([f"+recipe={preset}"] if preset else []),
                f"critic.url={url}",
                f"logging.run_dir={run_dir}",
                *overrides,
            ],
        )
    run(OmegaConf.to_object(dcfg))
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    return [r for r in rows if "objective/scores" in r] if scored_only else rows


def torchrun_actor(nproc: int, url: str, run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """The real command line: ``torchrun examples/train_actor.py +recipe=digits`` on ``nproc``
    processes."""
    from aligner.distributed import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(ROOT / "examples" / "train_actor.py"),
        "+recipe=digits",
        f"critic.url={url}",
        f"logging.run_dir={run_dir}",
        *overrides,
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(ROOT),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def critic_step(url: str) -> int:
    """The critic step the server at ``url`` holds."""
    from aligner.wire.client import RemoteCriticClient

    with RemoteCriticClient(url, timeout_s=30) as c:
        return int(c.server_info().critic_step)


def check_hf_export(folder: Path, task: str) -> None:
    """transformers loads the exported policy and, greedily, answers the task."""
    import torch
    from transformers import AutoModelForCausalLM

    from aligner.tasks import get_task
    from aligner.tokenizers import CharTokenizer

    tok = CharTokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    t = get_task(task, 3)
    prompts = t.prompts(32, seed=7)
    ids = torch.tensor([tok.encode(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id
        )
    answers = [tok.decode(row[ids.shape[1] :].tolist()) for row in out]
    score = sum(t.reward(prompts, answers)) / len(prompts)
    assert score > 0.5, list(zip(prompts, answers))[:4]


def best_window(rows: list[dict], n: int = 5) -> float:
    """The best mean reward over n consecutive steps: "reached 0.9 within the budget"."""
    s = [r["objective/scores"] for r in rows]
    return max(sum(s[i : i + n]) / n for i in range(len(s) - n + 1))
