"""Checkpoint files: safetensors for tensors, JSON for everything else, never pickle.

Every checkpoint directory is written under a temporary name and renamed into place, so a
crash at any moment leaves either the previous checkpoint or the new one whole, never a
half-written one under the final name. A directory counts as complete only when it carries a
``complete.json`` marker written last inside the temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = [
    "atomic_directory",
    "commit_directory",
    "rng_state_tensors",
    "restore_rng_state",
    "rng_to_restore",
    "save_tensors",
    "load_tensors",
    "write_json",
    "writing",
    "read_json",
    "optimizer_to_safe",
    "optimizer_from_safe",
    "step_dir_name",
    "parse_step_dir_name",
    "shard_file",
    "complete_steps",
    "prune_checkpoints",
    "clean_leftovers",
    "clean_leftovers_at_start",
    "CheckpointError",
    "COMPLETE_MARKER",
]

COMPLETE_MARKER = "complete.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp."
"""Directories being written: ``.tmp.<name>.<random>`` (:func:`atomic_directory`), or a writer's
own fixed ``.tmp.<name>`` (the actor's)."""
OLD_PREFIX = ".old."
"""The previous copy :func:`commit_directory` moves aside while it renames the new one in."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, malformed or incompatible; the message says which."""


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_directory(
    final: str | os.PathLike, marker: dict[str, Any] | None = None, *, mark_complete: bool = True
) -> Iterator[Path]:
    """Yield a temporary directory beside ``final``; on success, mark it complete and rename it
    to ``final`` (replacing an older one). On an exception the temporary directory is removed
    and ``final`` is untouched. ``mark_complete=False`` writes no ``complete.json`` (folders in
    another tool's layout, such as a HF model folder)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}.", dir=final.parent))
    try:
        yield tmp
        commit_directory(tmp, final, marker if mark_complete else None, mark_complete=mark_complete)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_directory(
    tmp: str | os.PathLike,
    final: str | os.PathLike,
    marker: dict[str, Any] | None = None,
    *,
    mark_complete: bool = True,
) -> None:
    """Finish a directory written under a temporary name: write the ``complete.json`` marker
    last, flush, and rename it to ``final`` (replacing an older one). For writers that fill one
    temporary directory from several processes before one of them commits it."""
    tmp, final = Path(tmp), Path(final)
    if mark_complete:
        write_json(tmp / COMPLETE_MARKER, marker or {})
    _fsync_dir(tmp)
    if final.exists():
        # Move the old one aside first: os.replace cannot replace a non-empty directory.
        # A kill between the two renames leaves this as the only complete copy under the step:
        # clean_leftovers renames it back at the next start.
        old = final.parent / f"{OLD_PREFIX}{final.name}.{os.getpid()}"
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)  # the previous copy back under its name
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def rng_state_tensors() -> dict[str, torch.Tensor]:
    """Every random-number state of this process as tensors: torch (CPU and CUDA), Python's
    ``random``, NumPy's global generator and Megatron's model-parallel RNG tracker."""
    import random

    import numpy as np

    out: dict[str, torch.Tensor] = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    version, words, gauss = random.getstate()
    out["python"] = torch.tensor([version, *words], dtype=torch.int64)
    out["python_gauss"] = torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    out["numpy_pos"] = torch.tensor([pos, has_gauss], dtype=torch.int64)
    out["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    try:
        from megatron.core import tensor_parallel

        for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
            out[f"tracker.{name}"] = state
    except Exception:  # no tracker set up in this process
        pass
    return out


def restore_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`rng_state_tensors`, for the states :func:`rng_to_restore` selected:
    torch's CPU generator alone (the layout written before every RNG was saved), or it with
    Python's and NumPy's, and the device states that fit."""
    import math
    import random

    import numpy as np

    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    if "python" in tensors:
        py = tensors["python"].tolist()
        gauss = float(tensors["python_gauss"][0])
        random.setstate((int(py[0]), tuple(int(w) for w in py[1:]), None if math.isnan(gauss) else gauss))
        pos, has_gauss = (int(x) for x in tensors["numpy_pos"].tolist())
        np.random.set_state(
            (
                "MT19937",
                tensors["numpy_keys"].numpy().astype(np.uint32),
                pos,
                has_gauss,
                float(tensors["numpy_gauss"][0]),
            )
        )
    tracker_states = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracker_states:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(tracker_states)


_PORTABLE_RNG = ("torch_cpu", "python", "python_gauss", "numpy_keys", "numpy_pos", "numpy_gauss")


def rng_to_restore(
    saved: dict[str, torch.Tensor], own: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The part of a checkpoint's RNG states (``saved``) that this process can restore, checked
    against its own (``own``, from :func:`rng_state_tensors`), and a note on what is left out
    (None when nothing is).

    torch's CPU state alone is the layout written before every RNG was saved. The device states
    (CUDA's generator, Megatron's tracker) are restored only when their names and shapes are
    this process's: a checkpoint from a GPU server loaded on a CPU one restores the portable
    states (torch's CPU generator, Python's, NumPy's) and says so. Raises
    :class:`CheckpointError` for a shard that is neither, before anything is applied.
    """

    def fits(k: str) -> bool:
        return k in saved and k in own and saved[k].shape == own[k].shape and saved[k].dtype == own[k].dtype

    if set(saved) == {"torch_cpu"} and fits("torch_cpu"):
        return dict(saved), None
    bad = [k for k in _PORTABLE_RNG if not fits(k)]
    if bad:
        raise CheckpointError(
            f"{where}: RNG states {bad} are missing or not of this process's shape "
            f"(the shard holds {sorted(saved)})"
        )
    out = {k: saved[k] for k in _PORTABLE_RNG}
    device, own_device = sorted(set(saved) - set(out)), sorted(set(own) - set(out))
    if device == own_device and all(fits(k) for k in device):
        out.update((k, saved[k]) for k in device)
        return out, None

    def shape(d: dict[str, torch.Tensor], k: str) -> object:
        return list(d[k].shape) if k in d else "absent"

    misfits = [
        f"{k} {shape(saved, k)} here {shape(own, k)}"
        for k in sorted(set(device) | set(own_device))
        if not fits(k)
    ]
    return out, (
        f"{where}: device RNG states do not fit this process ({'; '.join(misfits)}; saved on "
        "another kind of device?): restored torch's CPU, Python's and NumPy's generators only"
    )


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn a failed write (a full disk, a file-size limit, a read-only folder) into a
    :class:`CheckpointError` that names ``path``: the OS's own message often names no file."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot write {path}: {e}") from e


def save_tensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors (made contiguous, on CPU, not sharing storage) to a safetensors file."""
    clean = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    with writing(path):
        save_file(clean, str(path), metadata=metadata)
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"tensor file {str(path)!r} does not exist")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"tensor file {str(path)!r} is not a readable safetensors file: {e}") from e


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with writing(path), open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"metadata file {str(path)!r} does not exist")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"metadata file {str(path)!r} is not valid JSON: {e}") from e


def optimizer_to_safe(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a torch optimizer's state dict into tensors (for safetensors) and JSON metadata."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{pid}.{k}"] = v
            else:
                scalars.setdefault(str(pid), {})[k] = v
    meta = {
        "param_groups": sd["param_groups"],
        "scalars": scalars,
        "param_ids": [str(p) for p in sd["state"].keys()],
    }
    return tensors, meta


def optimizer_from_safe(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Inverse of :func:`optimizer_to_safe`."""
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = t
    for pid, sc in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(sc)
    own_groups = optimizer.state_dict()["param_groups"]
    # JSON turns tuples (Adam's betas) into lists; torch's optimizers expect tuples back.
    groups = [
        {k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
        for g in meta["param_groups"]
    ]
    if len(groups) != len(own_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, own_groups)
    ):
        raise CheckpointError(
            "optimizer state does not match the model's parameters: "
            f"saved groups of sizes {[len(g['params']) for g in groups]}, "
            f"expected {[len(g['params']) for g in own_groups]}"
        )
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def step_dir_name(step: int) -> str:
    """The folder of ``step``: ``step_`` and the step, zero-padded to 8 digits (longer steps
    take as many as they need: ``step_123456789``)."""
    return f"step_{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a folder named by :func:`step_dir_name`, of any size; None for any other
    name (another spelling of a step, such as ``step_000000001``, is not that step's folder)."""
    m = _STEP_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def shard_file(
    kind: str, *, tp: int = 0, pp: int = 0, dp: int | None = None, suffix: str = ".safetensors"
) -> str:
    """The one naming scheme of both roles' per-rank checkpoint files.

    ``{kind}_tp{tp:02d}_pp{pp:02d}{suffix}`` for what one model-parallel rank holds (shared by its
    data-parallel replicas: weights, optimizer state), and ``{kind}_tp.._pp.._dp{dp:03d}{suffix}``
    for what each rank holds alone (its random states). For example
    ``shard_file("optim", tp=1)`` is ``optim_tp01_pp00.safetensors`` and
    ``shard_file("rng", tp=0, pp=1, dp=2)`` is ``rng_tp00_pp01_dp002.safetensors``.
    """
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
        if v is not None and (not isinstance(v, int) or v < 0):
            raise ValueError(f"shard_file: {name}={v!r}, expected an integer >= 0")
    if not kind or "_" in kind or "/" in kind:
        raise ValueError(f"shard_file: kind={kind!r}, expected a non-empty name without '_' or '/'")
    rank = f"_tp{tp:02d}_pp{pp:02d}" + ("" if dp is None else f"_dp{dp:03d}")
    return f"{kind}{rank}{suffix}"


def _step_dirs(root: Path) -> Iterator[tuple[int, Path]]:
    """``(step, folder)`` of every folder under ``root`` named by :func:`step_dir_name`."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        step = parse_step_dir_name(child.name)
        if step is not None and child.is_dir():
            yield step, child


def complete_steps(root: str | os.PathLike, role: str | None = None) -> list[int]:
    """Steps under ``root`` with a complete checkpoint (and, if ``role`` is given, whose
    ``role`` sub-directory is complete too), ascending."""
    return sorted(
        step
        for step, child in _step_dirs(Path(root))
        if ((child / role if role else child) / COMPLETE_MARKER).is_file()
    )


def prune_checkpoints(
    root: str | os.PathLike,
    role: str,
    saved: int,
    keep_last: int,
    protect: set[int] | None = None,
    *,
    abandoned: Collection[int] = (),
) -> list[int]:
    """Remove ``role``'s sub-directories (``<root>/step_X/<role>``) right after step ``saved``
    was completed: those older than the newest ``keep_last`` up to ``saved`` (0 keeps all), and
    those after ``saved`` that are ``abandoned``: the continuation a run gave up when it loaded
    an earlier step (else a later resume would jump back to it). A step after ``saved`` that is
    not ``abandoned`` is never removed, nor a protected step, an incomplete one or another
    role's files; a step folder left empty goes too. Returns the removed steps."""
    protect = protect or set()
    steps = [s for s in complete_steps(root, role=role) if s not in protect]
    doomed = [s for s in steps if s > saved and s in abandoned]
    current = [s for s in steps if s <= saved]
    if keep_last > 0:
        # keep_last counts the newest steps including protected ones
        kept = sorted(set(current) | {s for s in protect if s <= saved})[-keep_last:]
        doomed += [s for s in current if s not in kept]
    for step in sorted(doomed):
        step_dir = Path(root) / step_dir_name(step)
        shutil.rmtree(step_dir / role, ignore_errors=True)
        with contextlib.suppress(OSError):
            step_dir.rmdir()  # only when no other role's files are left
    return sorted(doomed)


def clean_leftovers(root: str | os.PathLike, role: str) -> dict[str, list[str]]:
    """Tidy ``role``'s leftovers of interrupted saves under every step folder of ``root`` (call at
    start-up, before this role saves or loads; another role's files are never touched, as it may
    be saving right now).

    - ``.tmp.<role>`` and ``.tmp.<role>.*``, folders being written when the writer was killed: removed
      (:func:`commit_directory` renames one into place only with its marker, after the previous
      copy was moved aside, so one is never the step's only complete copy).
    - ``.old.<role>.*``, the previous copy :func:`commit_directory` moves aside before it renames the
      new one in: when ``<role>`` is missing (killed between the two renames) and it is complete,
      it is that step's only committed copy and is renamed back (the new copy beside it, complete
      as it may be, was never committed: its save never finished nor was answered, so it goes);
      otherwise removed.

    A step folder this leaves empty is removed. Returns the paths (relative to ``root``) ``"removed"``
    and ``"recovered"``."""
    root = Path(root)
    out: dict[str, list[str]] = {"removed": [], "recovered": []}
    tmp_name, tmp_prefix, old_prefix = f"{TMP_PREFIX}{role}", f"{TMP_PREFIX}{role}.", f"{OLD_PREFIX}{role}."
    for _, step_dir in sorted(_step_dirs(root)):
        final = step_dir / role
        olds = sorted(
            (p for p in step_dir.iterdir() if p.name.startswith(old_prefix) and p.is_dir()),
            key=lambda p: p.stat().st_mtime,
        )
        if not final.exists():
            whole = [p for p in olds if (p / COMPLETE_MARKER).is_file()]
            if whole:
                os.replace(whole[-1], final)  # the newest complete copy
                _fsync_dir(step_dir)
                out["recovered"].append(str(final.relative_to(root)))
                olds.remove(whole[-1])
        tmps = [p for p in step_dir.iterdir() if p.name == tmp_name or p.name.startswith(tmp_prefix)]
        for p in [*olds, *tmps]:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
            out["removed"].append(str(p.relative_to(root)))
        if olds or tmps:  # a folder this cleaning emptied (another one may be about to be filled)
            with contextlib.suppress(OSError):
                step_dir.rmdir()  # only when nothing is left in it
    return out


def clean_leftovers_at_start(root: str | os.PathLike, role: str, log: logging.Logger) -> None:
    """:func:`clean_leftovers` at a role's start-up, its outcome on ``log``: a recovered copy as a
    warning, the removed leftovers as info, and a failure as a warning (the checkpoints are then
    what they were; nothing is raised)."""
    try:
        done = clean_leftovers(root, role)
    except OSError as e:
        log.warning("cleaning the leftovers of killed saves under %s failed: %s", root, e)
        return
    if done["recovered"]:
        log.warning(
            "recovered %s: a save was killed mid-commit; its previous complete copy is back",
            done["recovered"],
        )
    if done["removed"]:
        log.info("removed the leftovers of killed saves under %s: %s", root, done["removed"])
