"""Helpers of the fault suite (``tests/test_faults.py``): a critic server that can be killed and
started again on the same ports and checkpoint folder, actor runs as real processes, the final
weights of a run, and the measurements the suite reports (resident memory, redone steps).

Both roles share one checkpoint folder per run, as docs/design.md ("Checkpoints") asks:
``<run>/ckpt/step_XXXXXXXX/{actor,critic}``. The runs are the copy task on 3 digits with 2-layer,
width-64 models (the actor's defaults), a few steps, so that a whole run takes seconds.

The critic servers score with :func:`copy_reward_or_raise`, imported by the server process from
this folder (:func:`server_env` puts it on the server's ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

STEPS = 6
"""PPO steps of every run of the suite."""
SAVE_INTERVAL = 2
"""Both roles save every 2 steps (2, 4, 6): what a rolled-back run falls back to."""

ACTOR_RUN = (
    "+recipe=digits",
    "data.task=copy",
    "data.num_digits=3",
    "generation.max_new_tokens=4",
    "ppo.global_batch_size=32",
    "ppo.mini_batch_size=32",
    "ppo.micro_batch_size=32",
    "ppo.ppo_epochs=2",
    "ppo.normalize_scores=true",
    "ppo.adaptive_kl=true",
    "optim.min_lr=1e-4",  # a decaying schedule: its position after a rollback matters
    f"ppo.num_steps={STEPS}",
    f"checkpoint.save_interval={SAVE_INTERVAL}",
    "checkpoint.keep_last=0",
    "checkpoint.keep_best=false",
    "validation.interval=0",
    "validation.before_train=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
)
"""The actor's overrides (besides the server's URL and the folders)."""

POISON_PROMPT = "99999:"
"""The one prompt :func:`copy_reward_or_raise` cannot score: five digits, which no run of the
suite draws (its prompts have three)."""

REWARD_FN = "_faults:copy_reward_or_raise"
"""``reward.fn`` of the suite's servers."""

MAX_BATCH = 16
"""``server.max_batch_size`` of every server of the suite: small, so that an over-long batch is
cheap. The actor cuts its 32-row ``critic_infer`` batches into requests of at most this many rows."""
MICRO_BATCH_TOKENS = 64
"""``max_tokens_per_micro_batch`` of every server of the suite: rows packed without padding (5 to 8
tokens each: a prompt ``ddd:`` and at most 4 new tokens), a 16-row request in two or three
micro-batches and a 32-row train in three to five, so that every run, the ones killed and
restarted included, exercises the packed plan."""
SERVER_SETTINGS = (
    f"server.max_batch_size={MAX_BATCH}",
    "server.max_queue_delay_us=20000",  # concurrent infer requests merge into one execution
    f"max_tokens_per_micro_batch={MICRO_BATCH_TOKENS}",
)
"""What every critic server of the suite runs with besides its ports and folders: the reference
run's (the shared server) and the ones killed and started again alike. A run ends as the
uninterrupted one bit for bit only against a server of the same settings: the actor cuts its
batches into requests of ``server.max_batch_size`` rows, and a forward rounds a row by where it
sits in its batch (docs/design.md, "Inference"). Packed, a row's neighbours are the other rows of
its request end to end: on a CPU the value head (``[T, hidden] x [hidden, 1]``, a matrix-vector
product) computes positions in blocks of 4 and the last ``T % 4`` apart, so a row's values can
change in the last bits when its request holds 16 rows instead of 32. (Padded, 16 rows of ``s``
positions keep the blocks where 32 rows have them, which hid a default ``max_batch_size`` on the
killed servers against 16 on the reference's: packed, the killed runs ended 1e-7 off.)"""


def copy_reward_or_raise(prompts: Sequence[str], responses: Sequence[str], **kw: object) -> list[float]:
    """The copy task's reward (``aligner.tasks.digits:copy_reward``), except that a batch holding
    :data:`POISON_PROMPT` raises: the reward function that fails on one sample."""
    from aligner.tasks.digits import copy_reward

    if POISON_PROMPT in prompts:
        raise ValueError("cannot score this batch")
    return copy_reward(prompts, responses, **kw)


# ----------------------------------------------------------------------------------------------
# The critic server
# ----------------------------------------------------------------------------------------------


def server_env(**extra: str) -> dict[str, str]:
    """Environment of a server process: this folder first on ``PYTHONPATH`` (for
    :data:`REWARD_FN`), then the repository (the package the tests import)."""
    path = os.pathsep.join([str(TESTS), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH", "")])])
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


@dataclass
class Critic:
    """A critic server bound to fixed ports and one checkpoint folder, so that it can be killed and
    started again where clients and actors expect it (``checkpoint.resume=auto`` on a restart),
    with :data:`SERVER_SETTINGS` (``extra`` may add settings, not change those).

    ``root/ckpt`` is the checkpoint folder (the actor's too), ``root/log`` its log folder; each
    start writes its stderr to ``root/server-<n>.log``.
    """

    root: Path
    extra: Sequence[str] = ()
    grpc_port: int = 0
    starts: int = 0
    process: object = None
    logs: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        from aligner.distributed import free_port

        settings = {o.split("=", 1)[0] for o in SERVER_SETTINGS}
        changed = [o for o in self.extra if o.split("=", 1)[0] in settings]
        assert not changed, f"{changed}: every server of the suite runs SERVER_SETTINGS (see there)"
        self.root = Path(self.root)
        self.grpc_port = self.grpc_port or free_port()

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def overrides(self) -> list[str]:
        return [
            f"server.grpc_port={self.grpc_port}",
            "server.metrics_port=null",
            "server.exit_timeout_s=1",
            "model.max_seq_len=16",
            "optim.lr=1e-3",
            f"reward.fn={REWARD_FN}",
            f"log.dir={self.root / 'log'}",
            "log.tensorboard=false",
            f"checkpoint.dir={self.ckpt}",
            "checkpoint.keep_last=0",
            "checkpoint.save_on_sigterm=false",
            "checkpoint.resume=auto",
            *SERVER_SETTINGS,
            *self.extra,
        ]

    def start(self, **env: str):
        """Start it (again) and return the :class:`~aligner.critic.launch.ServerProcess` once it
        serves; ``env``: extra environment (``ALIGNER_SERVER_FAULT_AT``)."""
        from aligner.critic.launch import start_server

        self.starts += 1
        log = self.root / f"server-{self.starts}.log"
        self.logs.append(log)
        self.process = start_server(self.overrides(), log_path=log, env=server_env(**env), cwd=ROOT)
        return self.process

    @property
    def pid(self) -> int:
        return self.process.pid  # type: ignore[attr-defined]

    def wait_dead(self, timeout_s: float) -> int:
        """Wait until the server process exits by itself (a fault point); then kill what is left
        of its process group (Triton, backend stubs), which would hold the ports. Its exit code."""
        proc = self.process.proc  # type: ignore[attr-defined]
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the critic server did not die within {timeout_s:.0f} s:\n{self.output_tail()}"
            ) from None
        self.process.kill()  # type: ignore[attr-defined]
        return code

    def kill(self) -> None:
        """SIGKILL the whole process group (fast teardown; nothing of the server is checked after)."""
        if self.process is not None:
            self.process.kill()  # type: ignore[attr-defined]

    def output_tail(self, n: int = 40) -> str:
        return self.process.output_tail(n) if self.process is not None else ""  # type: ignore[attr-defined]

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.is_file())


# ----------------------------------------------------------------------------------------------
# The actor
# ----------------------------------------------------------------------------------------------


def actor_cmd(url: str, run_dir: Path, ckpt: Path, *extra: str, nproc: int = 1) -> list[str]:
    """``python examples/train_actor.py`` against ``url``, logging under ``run_dir`` and saving
    under ``ckpt`` (the server's checkpoint folder when they share one); with ``nproc`` > 1 under
    ``torch.distributed.run`` on that many processes (the layout from ``extra``: data parallel by
    default)."""
    from aligner.distributed import free_port

    launcher = [sys.executable]
    if nproc > 1:
        launcher += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
    return [
        *launcher,
        str(ROOT / "examples" / "train_actor.py"),
        f"critic.url={url}",
        f"logging.run_dir={run_dir}",
        f"checkpoint.dir={ckpt}",
        *ACTOR_RUN,
        *extra,
    ]


def actor_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    for key in ("ALIGNER_FAULT_AT", "ALIGNER_SERVER_FAULT_AT"):
        if key not in extra:
            env.pop(key, None)
    return env


@dataclass
class ActorRun:
    """A finished actor process: exit code and output."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def tail(self, n: int = 3000) -> str:
        return (
            f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"
        )


def run_actor(
    url: str,
    run_dir: Path,
    ckpt: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    ok: bool = True,
    timeout_s: float = 300,
    max_file_size: int | None = None,
    nproc: int = 1,
) -> ActorRun:
    """Run the actor to its end (on ``nproc`` processes); with ``ok`` it must exit 0.
    ``max_file_size``: the largest file it may write (:func:`file_size_limited`)."""
    cmd = actor_cmd(url, run_dir, ckpt, *extra, nproc=nproc)
    if max_file_size is not None:
        cmd = file_size_limited(cmd, max_file_size)
    t0 = time.monotonic()
    out = subprocess.run(
        cmd, env=env or actor_env(), capture_output=True, text=True, timeout=timeout_s, cwd=str(ROOT)
    )
    run = ActorRun(out.returncode, out.stdout, out.stderr, time.monotonic() - t0)
    if ok:
        assert run.returncode == 0, run.tail()
    return run


class ActorProcess:
    """An actor started in the background (output to files under ``run_dir``)."""

    def __init__(
        self,
        url: str,
        run_dir: Path,
        ckpt: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        nproc: int = 1,
    ):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self._out = open(run_dir / "actor.stdout", "w")
        self._err = open(run_dir / "actor.stderr", "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            actor_cmd(url, run_dir, ckpt, *extra, nproc=nproc),
            env=env or actor_env(),
            stdout=self._out,
            stderr=self._err,
            cwd=str(ROOT),
        )

    def wait(self, timeout_s: float) -> ActorRun:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._stop()
            self._close()
            raise AssertionError(
                f"the actor did not finish within {timeout_s:.0f} s:\n{self.result(-9).tail()}"
            ) from None
        self._close()
        return self.result(code)

    def result(self, code: int) -> ActorRun:
        read = lambda name: (self.run_dir / name).read_text(errors="replace")  # noqa: E731
        return ActorRun(code, read("actor.stdout"), read("actor.stderr"), time.monotonic() - self.t0)

    def kill(self) -> None:
        self._stop()
        self._close()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM first: torchrun passes it on to its workers (each in a session of its own,
            # out of reach of a signal to its group) before it exits.
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _close(self) -> None:
        self._out.close()
        self._err.close()


@contextmanager
def serving_critic(root: Path) -> Iterator[Critic]:
    """A :class:`Critic` under ``root``, started, and killed on leaving (a module's shared server)."""
    critic = Critic(root)
    critic.start()
    try:
        yield critic
    finally:
        critic.kill()


def kill_server_mid_run(tmp_path: Path, fault: str, *actor_extra: str, nproc: int = 1):
    """Start a server that kills itself at ``fault`` (``ALIGNER_SERVER_FAULT_AT``), an actor
    against it sharing its checkpoint folder, then, once the server died, start it again on the
    same ports with ``checkpoint.resume=auto``. Returns the critic, the finished actor run and the
    newest complete critic checkpoint when the server died (what the restarted one must load).
    ``nproc``: the actor's processes (:func:`actor_cmd`)."""
    from aligner.checkpoint import complete_steps

    critic = Critic(tmp_path / "server")
    # Started first: the actor waits for the server to be ready (critic.ready_timeout_s), and its
    # own start-up overlaps the server's.
    actor = ActorProcess(critic.url, tmp_path / "actor", critic.ckpt, *actor_extra, nproc=nproc)
    try:
        critic.start(ALIGNER_SERVER_FAULT_AT=fault)
        code = critic.wait_dead(timeout_s=240)
        assert code == -signal.SIGKILL, (
            f"the server exited with {code}, not at {fault}:\n{critic.output_tail()}"
        )
        killed_at = sorted(complete_steps(critic.ckpt, role="critic"))
        critic.start()
        run = actor.wait(timeout_s=300)
    finally:
        actor.kill()
        critic.kill()
    # The restarted server took the newest complete critic checkpoint by itself.
    newest = killed_at[-1]
    assert f"loaded critic checkpoint step {newest}" in critic.logs[-1].read_text(), critic.log_text()[-3000:]
    return critic, run, newest


def metrics_steps(run_dir: Path) -> list[int]:
    """The steps logged in ``run_dir/metrics.jsonl`` so far (a file being written: partial last
    line ignored)."""
    import json

    path = run_dir / "metrics.jsonl"
    steps = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                pass
    return steps


# ----------------------------------------------------------------------------------------------
# What a run leaves behind
# ----------------------------------------------------------------------------------------------

CRITIC_SHARDS = ("model_tp00_pp00.safetensors", "optim_tp00_pp00.safetensors")


def final_weights(ckpt: Path, critic_ckpt: Path | None = None, step: int = STEPS) -> dict[str, dict]:
    """The tensors of both roles' checkpoints of ``step``: the actor's policy (under ``ckpt``),
    the critic's (master) weights and its optimizer state (under ``critic_ckpt``, by default the
    same folder)."""
    from aligner.checkpoint import load_tensors, step_dir_name

    actor = Path(ckpt) / step_dir_name(step) / "actor"
    critic = Path(critic_ckpt or ckpt) / step_dir_name(step) / "critic"
    out = {"actor/policy": load_tensors(actor / "policy" / "model.safetensors")}
    for name in CRITIC_SHARDS:
        out[f"critic/{name.split('_')[0]}"] = load_tensors(critic / name)
    return out


def same_metrics(got: list[dict], want: list[dict]) -> None:
    """Rows of two runs' ``metrics.jsonl`` (``aligner.metrics.read_metrics``: the newest row of a
    redone step wins) equal at every step, timers, throughput, memory and speed left out."""
    import pytest

    def keys(row: dict) -> set[str]:
        return {
            k
            for k in row
            if not k.startswith(("timers/", "perf/")) and k not in ("time", "throughput/tokens_per_s")
        }

    assert [r["step"] for r in got] == [r["step"] for r in want]
    for x, y in zip(got, want):
        assert keys(x) == keys(y), (x["step"], keys(x) ^ keys(y))
        for k in keys(y):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (x["step"], k, x[k], y[k])


def assert_same_weights(got: dict[str, dict], want: dict[str, dict]) -> None:
    """Every tensor of :func:`final_weights` equal, element for element."""
    import torch

    assert got.keys() == want.keys()
    for part in want:
        assert got[part].keys() == want[part].keys(), part
        differ = {
            k: float((got[part][k].double() - want[part][k].double()).abs().max())
            for k in want[part]
            if not torch.equal(got[part][k], want[part][k])
        }
        assert not differ, f"{part}: {len(differ)} tensor(s) differ from the uninterrupted run: {differ}"


REDONE = re.compile(
    r"critic server restarted \(critic step (-?\d+), expected (-?\d+)\): rolled both roles back to step "
    r"(\d+); steps (\d+)\.\.(\d+) are redone"
)


def rollbacks(text: str) -> list[dict[str, int]]:
    """The actor's rollback lines, parsed: ``server_step``, ``expected``, ``to``, ``first``,
    ``last`` (steps ``first..last`` redone)."""
    keys = ("server_step", "expected", "to", "first", "last")
    return [dict(zip(keys, map(int, m))) for m in REDONE.findall(text)]


def rss_mib(pid: int) -> float:
    """Resident memory of a process (``VmRSS`` in ``/proc``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# ----------------------------------------------------------------------------------------------
# A full disk
# ----------------------------------------------------------------------------------------------


def limit_file_size(pid: int, nbytes: int | None) -> None:
    """Cap the size of any file process ``pid`` writes (``RLIMIT_FSIZE``; None lifts it): a write
    past it fails with EFBIG, as a full disk fails one with ENOSPC. Python ignores SIGXFSZ (the
    signal the kernel sends as well), so the writer sees an ``OSError``, not a kill. Needs no
    privilege (lowering a limit never does), unlike mounting a small tmpfs."""
    soft = resource.RLIM_INFINITY if nbytes is None else nbytes
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


_LIMITED = """\
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
os.execv(sys.argv[2], sys.argv[2:])
"""


def file_size_limited(cmd: Sequence[str], nbytes: int) -> list[str]:
    """``cmd`` run with :func:`limit_file_size` applied from its first instruction: a small Python
    program sets the limit (and ignores SIGXFSZ) and replaces itself with ``cmd``, which keeps
    both (a ``preexec_fn`` would do the same, but is unsafe in a parent with threads)."""
    return [sys.executable, "-c", _LIMITED, str(nbytes), *cmd]


# ----------------------------------------------------------------------------------------------
# Raw critic_infer requests (what any client could send) and what they must get
# ----------------------------------------------------------------------------------------------

MALFORMED = ("dtype", "lengths", "prompt_lengths", "batch")
"""The malformed critic_infer requests of the load case (:func:`infer_request`)."""


def samples_batch(prompts: Sequence[str], responses: Sequence[str], s: int):
    """``prompt + response + eos`` per sample with the 'char' tokenizer, right-padded to ``s``:
    tokens ``[b, s]``, lengths ``[b]``, prompt_lengths ``[b]`` (int64)."""
    import numpy as np

    from aligner.tokenizers import build_tokenizer

    tok = build_tokenizer("char")
    ids = [tok.encode(p) + tok.encode(r) + [tok.eos_id] for p, r in zip(prompts, responses)]
    tokens = np.full((len(ids), s), tok.pad_id, dtype=np.int64)
    for i, row in enumerate(ids):
        tokens[i, : len(row)] = row
    lengths = np.array([len(r) for r in ids], np.int64)
    return tokens, lengths, np.array([len(tok.encode(p)) for p in prompts], np.int64)


def infer_request(kind: str, tokens, lengths, prompt_lengths, *, max_batch: int) -> tuple[dict, str]:
    """The inputs of one critic_infer request of ``kind`` ('good' or one of :data:`MALFORMED`)
    made from a valid batch (tokens ``[b, s]``, lengths and prompt_lengths ``[b]``), and what the
    error of a malformed one must name."""
    import numpy as np

    def col(a) -> np.ndarray:
        return np.asarray(a, np.int64).reshape(-1, 1)

    inputs = {"tokens": tokens, "lengths": col(lengths), "prompt_lengths": col(prompt_lengths)}
    if kind == "good":
        return inputs, ""
    if kind == "dtype":
        return {**inputs, "tokens": tokens.astype(np.int32)}, "'tokens'"
    if kind == "lengths":  # beyond the padded length s
        return {**inputs, "lengths": col(lengths + tokens.shape[1])}, "'lengths'"
    if kind == "prompt_lengths":  # no response token left
        return {**inputs, "prompt_lengths": col(lengths)}, "'prompt_lengths'"
    if kind != "batch":
        raise ValueError(f"kind {kind!r}: expected 'good' or one of {MALFORMED}")
    # Over-long: Triton rejects it itself, before any Python runs, and its message names the
    # limit and the model (no field).
    n = max_batch // len(tokens) + 1
    return {k: np.tile(v, (n, 1)) for k, v in inputs.items()}, f"batch-size must be <= {max_batch}"


def judge(kind: str, needle: str, got, expected: tuple, *, atol: float) -> str | None:
    """None when ``got`` (the outputs by name, or the error) is what a request of ``kind`` must
    get; 'retry' for a valid request that failed only as the peer of an invalid one merged with it
    (clients resend those); otherwise what was wrong. ``expected``: the (values ``[b, s-1]``,
    rewards ``[b]``) the request gets alone; values may move by ``atol``, rewards not at all."""
    import numpy as np

    from aligner.wire.protocol import BATCH_PEER_MARK

    if isinstance(got, Exception):
        text = str(got)
        if kind == "good":
            return "retry" if BATCH_PEER_MARK.strip() in text else f"good: {text[-400:]}"
        return None if needle in text else f"{kind}: the error does not name {needle}: {text[-400:]}"
    if kind != "good":
        return f"{kind}: accepted"
    values, rewards = expected
    if got["error"].reshape(-1).tolist() != [b""] * len(rewards):
        return f"good: error rows {got['error'].reshape(-1).tolist()}"
    if not np.array_equal(got["rewards"].reshape(-1), rewards):
        return f"good: rewards {got['rewards'].reshape(-1)}, expected {rewards}"
    if got["values"].shape != values.shape or not np.allclose(got["values"], values, rtol=0, atol=atol):
        return f"good: values differ from the request's alone by {np.abs(got['values'] - values).max()}"
    return None


def send_infer(conn, inputs: dict) -> dict:
    """One critic_infer through a bare ``tritonclient.grpc`` client ``conn`` (no validation, no
    retries); every output (values, rewards, error) by name."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from aligner.wire.protocol import INFER

    names = {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}
    ins = []
    for name, a in inputs.items():
        i = grpcclient.InferInput(name, list(a.shape), names[a.dtype])
        i.set_data_from_numpy(a)
        ins.append(i)
    r = conn.infer(INFER, ins, client_timeout=60)
    return {n: r.as_numpy(n) for n in ("values", "rewards", "error")}


def infer_together(url: str, work: Sequence[tuple[Sequence[str], Sequence[str]]], s: int) -> list:
    """Send one raw critic_infer per (prompts, responses) of ``work`` at the same moment, each from
    its own thread and connection, padded to ``s`` (one shape: the batcher merges only those);
    what each got: its outputs by name, or the error."""
    import threading

    import tritonclient.grpc as grpcclient

    results: list = [None] * len(work)
    start = threading.Barrier(len(work))

    def send(i: int) -> None:
        tokens, lengths, pl = samples_batch(*work[i], s)
        conn = grpcclient.InferenceServerClient(url.split("://", 1)[1])
        try:
            start.wait()
            results[i] = send_infer(
                conn, {"tokens": tokens, "lengths": lengths[:, None], "prompt_lengths": pl[:, None]}
            )
        except Exception as e:  # noqa: BLE001 - what each request got is the caller's to judge
            results[i] = e
        finally:
            conn.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(work))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def last_error(text: str) -> str:
    """The last ``SomeError: message`` line of a traceback."""
    lines = [line for line in text.splitlines() if re.match(r"^[\w.]*(Error|Exception): ", line)]
    return lines[-1] if lines else text.strip().splitlines()[-1]


def tensors_equal(a: dict, b: dict) -> bool:
    """Two dicts of tensors with the same names and equal tensors."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
