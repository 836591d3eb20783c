"""The fault points both roles share (:mod:`aligner.faults`): what a setting means, the error a
malformed one gets, and the kill itself (in a child process)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner.faults import ACTOR, SERVER

ROOT = Path(__file__).resolve().parents[1]


def test_settings_parse_to_a_point_and_a_step():
    assert SERVER.parse(None) is None and SERVER.parse("") is None
    assert SERVER.parse("train@3") == ("train", 3)
    assert ACTOR.parse("before_commit@4") == ("before_commit", 4)
    assert ACTOR.parse("before_commit") == ("before_commit", None)  # the actor's: any step


@pytest.mark.parametrize(
    "faults, value",
    [
        (SERVER, "train"),
        (SERVER, "train@x"),
        (SERVER, "mid_step@3"),
        (ACTOR, "train@3"),
        (ACTOR, "mid_step@"),
    ],
)
def test_a_malformed_setting_names_the_variable_and_the_points(faults, value):
    with pytest.raises(ValueError, match=re.escape(f"{faults.env}={value!r}: expected <point>")) as e:
        faults.parse(value)
    assert str(list(faults.points)) in str(e.value)


def test_a_point_not_named_or_at_another_step_does_nothing(monkeypatch):
    monkeypatch.setenv(SERVER.env, "train@3")
    SERVER.hit("train", 2)
    SERVER.hit("save", 3)
    monkeypatch.setenv(SERVER.env, "not a setting")
    SERVER.hit("train", 3)  # a malformed setting never fires (the server refuses it at start)


@pytest.mark.parametrize("setting, fires", [("mid_step@2", True), ("mid_step", True), ("mid_step@3", False)])
def test_the_named_point_kills_the_process_and_its_children(setting, fires):
    child = (
        "import subprocess, sys, time\n"
        "from aligner.faults import ACTOR\n"
        "sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(sleeper.pid, flush=True)\n"
        "ACTOR.hit('mid_step', 2)\n"
        "sleeper.kill()\n"
    )
    env = {**os.environ, ACTOR.env: setting, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    sleeper = int(out.stdout.split()[0])
    assert (out.returncode == -signal.SIGKILL) == fires, out.stderr
    try:  # the grandchild is gone either way (killed with its parent, or by it)
        os.waitpid(sleeper, os.WNOHANG)
    except ChildProcessError:
        pass

    def gone() -> bool:  # or dead and not yet reaped; a SIGKILL takes effect within moments
        try:
            return "Z" in Path(f"/proc/{sleeper}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()
