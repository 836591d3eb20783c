"""What the critic server trusts (README.md, "What the server trusts"): when it requires the run
token, the token file it makes when it must require one and none was configured, keeping the
token out of its children's environment, what ``server_info`` tells a caller without the token,
and how refused requests are logged.

- A token is required whenever the server can be reached beyond loopback (``server.host`` is not
  127.0.0.0/8, ::1 or localhost) or HTTP is on (a web page can make a browser send a CORS-simple
  POST to an HTTP endpoint; with a token required for every mutating call it cannot change
  state). With none configured (``server.run_token_file``, ``$ALIGNER_RUN_TOKEN``) the server
  makes one in ``<log.dir>/run_token`` (mode 0600; a restart on the same ``log.dir`` reuses it,
  so the actor keeps working) and logs the file's path, never the token.
  ``server.allow_no_token=true`` serves without one anyway (isolated networks), with a warning.
- ``server_info`` answers every caller (the probe and readiness checks send no token), but when
  the server has a token, a caller that does not send it gets only what a client needs to check
  compatibility (:data:`PUBLIC_INFO_FIELDS`): no paths, pid, optimizer or checkpoint steps.
- PyTriton hands Triton its admin token (loading and unloading models) on ``tritonserver``'s
  command line, the only way the bundled Triton takes it; once Triton runs, the server overwrites
  it there (:func:`hide_admin_token`), so the process list shows ``x``s from then on.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from aligner.wire.protocol import (
    RUN_TOKEN_ENV,
    ServerInfo,
    check_run_token,
    neutralize,
    validate_run_token,
)

__all__ = [
    "TOKEN_FILE_NAME",
    "PUBLIC_INFO_FIELDS",
    "TokenFileError",
    "is_loopback",
    "token_required_reason",
    "server_run_token",
    "drop_token_env",
    "info_for",
    "RefusalLog",
    "hide_admin_token",
]

log = logging.getLogger("aligner.critic")

TOKEN_FILE_NAME = "run_token"
"""The token file the server makes under ``log.dir`` when it must require a token and has none."""

PUBLIC_INFO_FIELDS = (
    "protocol_version",
    "vocab_size",
    "max_seq_len",
    "tokenizer_fingerprint",
    "critic_step",
    "max_batch_size",
    "max_train_batch",
    "instance_id",
    "run_token_required",
    "infer_inputs",
    "critic",
    "infer_wait_s",
)
"""What ``server_info`` tells a caller without the run token (when the server has one): what the
client checks before it sends anything (protocol, limits, tokenizer fingerprint, critic step,
instance, inputs, mode, the infer wait). The rest (reward paths, model, parallel sizes, checkpoint steps,
batching, pid, start time, optimizer) goes only to a caller that sends the token."""


class TokenFileError(RuntimeError):
    """The server's token file exists but cannot be trusted or read (the message names it)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine: localhost, 127.0.0.0/8 or ::1."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_required_reason(host: str, http_on: bool, tls_on: bool = False) -> str | None:
    """Why a server bound to ``host`` (HTTP on or off; TLS, which gives PyTriton a loopback HTTP
    endpoint of its own, on or off) must require a run token; None when it need not."""
    reasons = []
    if not is_loopback(host):
        reasons.append(f"server.host={host} is reachable beyond loopback")
    if http_on:
        reasons.append("HTTP is on (server.http_port)")
    if tls_on:
        reasons.append("TLS is on (server.tls: PyTriton manages Triton over a loopback HTTP endpoint)")
    return " and ".join(reasons) or None


def server_run_token(cfg: Any, configured: str | None) -> str | None:
    """The token the server requires: ``configured`` (from ``server.run_token_file`` or
    ``$ALIGNER_RUN_TOKEN``) when set; else, when one is required (:func:`token_required_reason`),
    the one in ``<log.dir>/run_token`` (made now, or reused from an earlier start); else None.

    Raises:
        TokenFileError: when that file exists but is no regular file of this user with mode 0600
            (or is empty).
    """
    s = cfg.server
    reason = token_required_reason(s.host, s.http_port is not None, s.tls.on)
    if configured is not None or reason is None:
        return configured
    if s.allow_no_token:
        log.warning(
            "SERVING WITHOUT A RUN TOKEN although %s (server.allow_no_token=true): anyone who reaches "
            "this server may train, save and load its critic and read its full server_info",
            reason,
        )
        return None
    path = Path(cfg.log.dir).resolve() / TOKEN_FILE_NAME
    made = _read_or_create(path)
    log.warning(
        "%s and no run token was configured: requiring the run token %s %s (mode 0600); give the "
        "actor critic.run_token_file=%s",
        reason,
        "made in" if made[1] else "reused from",
        path,
        path,
    )
    return made[0]


def _read_or_create(path: Path) -> tuple[str, bool]:
    """(the token in ``path``, whether it was made now). Made with O_EXCL and mode 0600, so it is
    never readable by others, not even for a moment; an existing one is reused only if it is a
    regular file (not a link) of this user that no one else may read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _reuse(path), False
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token, True


def _reuse(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise TokenFileError(f"run token file {path} cannot be read: {e.strerror}") from None
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise TokenFileError(
                f"run token file {path} is not a regular file of this user with mode 0600 "
                f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); remove it to make a new one"
            )
        token = f.read().strip()
    if not token:
        raise TokenFileError(f"run token file {path} is empty; remove it to make a new one")
    return token


def drop_token_env() -> None:
    """Remove ``$ALIGNER_RUN_TOKEN`` from this process's environment (read already), so that Triton
    and its Python backend stubs, started after this, never hold it."""
    os.environ.pop(RUN_TOKEN_ENV, None)


def info_for(info: ServerInfo, required: str | None, given: Any) -> ServerInfo:
    """The ``server_info`` a caller gets: all of ``info`` when the server has no token
    (``required`` None) or the caller sent it; only :data:`PUBLIC_INFO_FIELDS` when it sent none.

    Raises:
        UnauthorizedError: when it sent a token that is not the server's (a misconfigured actor
            learns it at once, not at its first critic_train).
    """
    if required is None:
        return info
    token = "" if given is None else validate_run_token("server_info", given)
    if token:
        check_run_token("server_info", required, token)
        return info
    kept = {f.name: getattr(info, f.name) for f in fields(info) if f.name in PUBLIC_INFO_FIELDS}
    return ServerInfo(tokenizer="", full=False, **kept)


class RefusalLog:
    """Logs refused requests, throttled: at most one line per (model, kind of refusal) per
    ``interval_s``, counting those it left out, and no traceback (a refusal is expected: bad input,
    a missing or wrong token, a fenced step)."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], list[float]] = {}  # key -> [time logged, left out since]

    def refused(self, model: str, error: BaseException) -> None:
        kind = type(error).__name__
        now = self.clock()
        with self._lock:
            seen = self._last.get((model, kind))
            if seen is not None and now - seen[0] < self.interval_s:
                seen[1] += 1
                return
            left_out = 0 if seen is None else int(seen[1])
            self._last[(model, kind)] = [now, 0]
        more = f" (and {left_out} more {kind} since the last such line)" if left_out else ""
        self.logger.warning("%s refused: %s%s", model, neutralize(str(error), 300), more)


_RESTRICTED = (b"--grpc-restricted-protocol", b"--http-restricted-api")


def hide_admin_token(root: int) -> int:
    """Overwrite, in place, the admin token on the command line of every ``tritonserver`` under
    process ``root`` (its ``--grpc-restricted-protocol`` and ``--http-restricted-api`` values,
    ``<apis>:<header>=<token>``), so that ``/proc/<pid>/cmdline`` no longer shows it. Triton read
    its arguments when it started and keeps its own copy; the bytes are overwritten through
    ``/proc/<pid>/mem``, which a parent may write to (a ptrace-mode access: same user, and a Yama
    ``ptrace_scope`` of at most 1). Returns how many processes were changed; one that could not be
    is logged (the token stays visible to local users then, as README says), never raised.
    """
    from aligner.critic.host import descendants

    changed = 0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            if not args or not args[0].endswith(b"tritonserver"):
                continue
            tokens = set()
            for i, a in enumerate(args):  # --flag=<value> or --flag <value>
                flag, eq, value = a.partition(b"=")
                if flag in _RESTRICTED and not eq and i + 1 < len(args):
                    value = args[i + 1]
                elif flag not in _RESTRICTED:
                    continue
                token = value.partition(b":")[2].partition(b"=")[2]  # <apis>:<header>=<token>
                if token:
                    tokens.add(token)
            if not tokens:
                continue
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields_ = f.read().rsplit(b")", 1)[1].split()
            start, end = int(fields_[45]), int(fields_[46])  # arg_start, arg_end (stat fields 48, 49)
            with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
                mem.seek(start)
                area = mem.read(end - start)
                hidden = area
                for t in tokens:
                    hidden = hidden.replace(t, b"x" * len(t))
                mem.seek(start)
                mem.write(hidden)
            changed += 1
        except OSError as e:
            log.warning(
                "could not hide Triton's admin token on its command line (pid %d: %s); local users "
                "who can list processes can read it (README, 'What the server trusts')",
                pid,
                e.strerror or e,
            )
    return changed
