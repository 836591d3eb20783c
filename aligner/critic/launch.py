"""Start a critic server as a child process and wait until it serves (demo launcher, tests,
benchmarks); the wait is :func:`aligner.wire.readiness.wait_ready`, the probe the client shares."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from aligner.critic.host import descendants
from aligner.wire.readiness import ServerStartError, wait_ready
from aligner.wire.tls import ClientTLS

__all__ = ["ServerProcess", "start_server", "SERVER_MODULE"]

SERVER_MODULE = "aligner.critic.server"
"""What the child runs, as ``python -m``: the server's entry point, found wherever the package is
installed."""


def _child_pythonpath(inherited: str) -> str:
    """``PYTHONPATH`` for the child: the folder this package was imported from first, so that the
    child runs the same code as its parent even from a checkout that is not installed; unchanged
    when that folder is the interpreter's site-packages (placed on PYTHONPATH it would come
    before the standard library)."""
    import site
    import sysconfig

    parent = Path(__file__).resolve().parents[2]
    site_dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    site_dirs |= {*site.getsitepackages(), site.getusersitepackages()}
    if any(Path(d).resolve() == parent for d in site_dirs):
        return inherited
    return os.pathsep.join([str(parent)] + [p for p in inherited.split(os.pathsep) if p])


_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)


class ServerProcess:
    """A running ``python -m aligner.critic.server`` child (in its own process group)."""

    def __init__(
        self, proc: subprocess.Popen, log_path: Path | None, nproc: int = 1, tls: ClientTLS | None = None
    ) -> None:
        self.proc = proc
        self.tls = tls
        """What the readiness check of a ``grpcs://`` server trusts (and presents)."""
        self.nproc = nproc
        self.log_path = log_path
        self.url: str = ""
        self.http_url: str = ""
        """Empty when the server serves no HTTP (the default)."""
        self.ports: dict[str, int] = {}
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._groups: set[int] = set()
        self._signalled_out = False
        self._reader = threading.Thread(target=self._read_stdout, daemon=True, name="critic-server-stdout")
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self._lines.append(line)
            if len(self._lines) > 500:
                del self._lines[:100]
            if line.startswith("PORTS "):
                self.ports = {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
            elif line.startswith("READY "):
                self.url = line.split(" ", 1)[1].strip()
                host = self.url.split("://", 1)[1].rsplit(":", 1)[0]
                if self.ports.get("http"):  # http=0: HTTP off (server.http_port null)
                    self.http_url = f"http://{host}:{self.ports['http']}"
                self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def output_tail(self, n: int = 40) -> str:
        text = "\n".join(self._lines[-n:])
        if self.log_path and self.log_path.exists():
            text += "\n--- stderr (" + str(self.log_path) + ") ---\n"
            text += "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return text

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                self._reader.join(timeout=2)
                raise ServerStartError(
                    f"critic server exited with code {self.proc.returncode} before READY:\n"
                    f"{self.output_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(
                    f"critic server printed no READY line within {timeout_s:.0f} s:\n{self.output_tail()}"
                )
        wait_ready(
            self.url, timeout_s=max(1.0, deadline - time.monotonic()), abort=self._exit_reason, tls=self.tls
        )
        self._note_groups()  # the workers' groups, should torchrun exit before stop() is called

    def _exit_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        self._reader.join(timeout=2)
        return f"the server process exited with code {code}:\n{self.output_tail()}"

    def _note_groups(self) -> None:
        """Remember the process groups of the server's descendants, while it runs. torchrun
        starts each worker in a session of its own, with Triton and its stubs under it:
        signalling the launcher's group alone would leave those running once torchrun is gone."""
        if self.proc.poll() is None:
            self._groups |= _descendant_groups(self.proc.pid) - {os.getpgrp()}

    def _signal_group(self, sig: int) -> None:
        """Signal the server's group and its descendants' (once: after that the numbers may
        belong to other processes)."""
        if self._signalled_out:
            return
        for group in {self.proc.pid, *self._groups}:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (clean shutdown, save-on-sigterm), then SIGKILL after ``timeout``; the exit code.

        Under torchrun the signal goes to the rank-0 worker (its pid is in the PORTS line): it
        shuts down cleanly and releases its peers, and torchrun then exits 0. (torchrun itself
        answers SIGTERM by terminating its workers, which also shut down cleanly, but exits 1.)
        """
        self._note_groups()
        if self.proc.poll() is None:
            target = self.ports.get("pid", self.proc.pid) if self.nproc > 1 else self.proc.pid
            try:
                os.kill(target, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        self._signal_group(signal.SIGKILL)  # stray children (Triton, stubs) if any
        self._signalled_out = True
        self._reader.join(timeout=2)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group (server, Triton, Python backend stubs) at once."""
        self._note_groups()
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return
        self._signalled_out = True

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _descendant_groups(root: int) -> set[int]:
    """The process groups of ``root``'s live descendants (Linux ``/proc``; empty elsewhere)."""
    return set(descendants(root).values())


def start_server(
    overrides: Sequence[str] = (),
    *,
    python: str = sys.executable,
    ready_timeout_s: float = 120.0,
    log_path: str | os.PathLike | None = None,
    nproc: int = 1,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    tls: ClientTLS | None = None,
) -> ServerProcess:
    """Start ``python -m aligner.critic.server <overrides>`` and return once it printed READY and
    answers.

    Args:
        overrides: Hydra overrides, e.g. ``["server.grpc_port=0", "reward.fn=aligner.tasks.digits:copy_reward"]``.
        python: interpreter to run it with.
        ready_timeout_s: how long to wait for READY and readiness.
        log_path: where the server's stderr goes (default: a new temporary file).
        nproc: > 1 launches it under ``torchrun --nproc_per_node nproc`` (tensor parallel critic).
        cwd: working directory (default: the caller's); relative paths in ``overrides`` and the
            PyTriton cache (``.cache``) are taken from it.
        env: extra environment variables.
        tls: for a server with ``server.tls`` on, what its readiness check trusts (its CA) and,
            with mutual TLS, presents (a client certificate).

    Raises:
        ServerStartError: with the server's last output, if it exits or never becomes ready.
    """
    full_env = dict(os.environ)
    # A parent that joined a torch.distributed world of its own (tests do) must not hand its
    # rendezvous to the server, which would try to bind the same MASTER_PORT.
    for key in _DIST_ENV:
        full_env.pop(key, None)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env["PYTHONPATH"] = _child_pythonpath(full_env.get("PYTHONPATH", ""))
    full_env.update(env or {})
    if nproc > 1:
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            SERVER_MODULE,
            *overrides,
        ]
    else:
        cmd = [python, "-m", SERVER_MODULE, *overrides]
    if log_path is None:
        import tempfile

        fd, name = tempfile.mkstemp(prefix="critic-server-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stderr = open(log_path, "w")
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=full_env,
            cwd=None if cwd is None else str(cwd),
            start_new_session=True,
        )
    finally:
        stderr.close()
    server = ServerProcess(proc, log_path, nproc=nproc, tls=tls)
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.kill()
        raise
    return server
