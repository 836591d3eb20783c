"""What a critic server needs of its host before Triton starts: the environment the bundled
Triton's Python backend needs (docs/platform.md, "PyTriton"), the leftovers of servers that died
without cleaning up, and ports that are free to bind; and its logging.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "PortInUseError",
    "check_ports_free",
    "parallel_model_cleanup",
    "connectable_host",
    "descendants",
    "pid_alive",
    "prepare_environment",
    "remove_stale_workspaces",
    "setup_logging",
]


def prepare_environment(cache_root: str | os.PathLike | None = None) -> Path:
    """Set what the bundled Triton needs, before it starts.

    - ``LD_LIBRARY_PATH`` starts with this interpreter's ``LIBDIR``, so the Python backend stub
      loads the same libpython as the running interpreter (not one the system finds first);
    - ``XDG_CACHE_HOME`` / ``PYTRITON_HOME`` point at a project-local cache (default ``.cache``
      in the working directory) instead of ``~/.cache``;
    - glibc's ``MALLOC_MMAP_THRESHOLD_`` (1 MiB) and ``MALLOC_TRIM_THRESHOLD_`` (16 MiB), unless
      set, for Triton and its stubs (this process's own allocator is set by ``mallopt``): a
      large request's buffers are handed back to the system once freed, not kept in their heaps
      (:mod:`aligner.critic.budget`).

    Returns the PyTriton workspace root.
    """
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(16 << 20))
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
        if not parts or parts[0] != libdir:
            os.environ["LD_LIBRARY_PATH"] = ":".join([libdir] + [p for p in parts if p != libdir])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.cwd() / ".cache").resolve()
    os.environ["XDG_CACHE_HOME"] = str(cache)
    root = Path(cache_root).resolve() if cache_root else cache / "pytriton"
    os.environ.setdefault("PYTRITON_HOME", str(root))
    root.mkdir(parents=True, exist_ok=True)
    return root


def descendants(root: int) -> dict[int, int]:
    """``root``'s live descendants: pid -> process group (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {}
    for name in names:
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid, ppid, pgid = int(name), int(fields[1]), int(fields[2])
        children.setdefault(ppid, []).append(pid)
        groups[pid] = pgid
    found: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = groups[pid]
        todo.extend(children.get(pid, []))
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_workspaces(root: Path) -> None:
    """Leftovers of critic servers that died without cleaning up (SIGKILL): their PyTriton
    workspaces (~22 MB each) and the Python backend's shared-memory regions in /dev/shm, which
    PyTriton names ``pytrtion<pid>-...`` after the server's pid."""
    for d in root.glob("critic-*"):
        try:
            pid = int(d.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
    shm = Path("/dev/shm")
    if shm.is_dir():
        for f in shm.glob("pytrtion*-*"):
            digits = f.name[len("pytrtion") :].split("-", 1)[0]
            if digits.isdigit() and not pid_alive(int(digits)):
                try:
                    f.unlink()
                except OSError:
                    pass


class PortInUseError(RuntimeError):
    """A configured port is taken by another process (Triton would otherwise hang at start-up)."""


def check_ports_free(host: str, ports: dict[str, int | None]) -> None:
    """Raise :class:`PortInUseError` naming every ``server.<key>`` port something listens on.

    Bound with SO_REUSEADDR as servers are, so ports in TIME_WAIT after a restart count as free.
    """
    taken = []
    for key, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                taken.append(f"server.{key}={port} ({e.strerror})")
    if taken:
        raise PortInUseError(
            f"cannot serve on {host}: {', '.join(taken)}; stop what uses it or pick another "
            "port (0 picks a free one)"
        )


def connectable_host(host: str) -> str:
    """The address a local client dials for a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def parallel_model_cleanup(triton: Any) -> None:
    """Make ``Triton.stop()`` tear down the model proxies concurrently.

    PyTriton 0.7 stops tritonserver and then cleans each bound model in turn, about 1 s each
    (mostly waiting on its threads); with five models that is ~5 s of a ~7 s stop. Each
    model's ``clean`` is wrapped so that the first call starts all of them at once. Uses
    PyTriton internals (``_model_manager``); if they change, stopping is just slower.
    """
    models = list(getattr(getattr(triton, "_model_manager", None), "models", None) or [])
    if len(models) < 2 or not all(callable(getattr(m, "clean", None)) for m in models):
        return
    originals = {id(m): m.clean for m in models}
    threads: dict[int, threading.Thread] = {}
    lock = threading.Lock()

    def start_all() -> None:
        with lock:
            if not threads:
                for m in models:
                    th = threading.Thread(target=originals[id(m)], name=f"clean-{m.model_name}", daemon=True)
                    th.start()
                    threads[id(m)] = th

    for m in models:

        def clean(m=m) -> None:
            start_all()
            threads[id(m)].join()

        m.clean = clean


def setup_logging(level_name: str, log_dir: str | os.PathLike, rank: int) -> None:
    """The critic server's logging: to stderr, and on rank 0 to ``<log_dir>/server.log`` too."""
    level = getattr(logging, level_name.upper())
    fmt = f"%(asctime)s %(levelname)s [critic rank {rank}] %(message)s"
    root = logging.getLogger()
    root.setLevel(level)
    if not any(getattr(h, "_aligner_critic", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(fmt))
        h._aligner_critic = True  # type: ignore[attr-defined]
        root.addHandler(h)
        if rank == 0:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            fh = logging.FileHandler(Path(log_dir) / "server.log")
            fh.setFormatter(logging.Formatter(fmt))
            fh._aligner_critic = True  # type: ignore[attr-defined]
            root.addHandler(fh)
    for noisy in ("pytriton", "tritonclient", "sh", "torch.distributed"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    # PyTriton logs a traceback (~2 KB) at WARNING for every request a callable refuses; the
    # callables log refusals themselves (throttled, security.RefusalLog) and unexpected errors
    # with their traceback, so only its errors (an unrecoverable one) are left to it.
    logging.getLogger("pytriton.proxy.inference").setLevel(max(level, logging.ERROR))
