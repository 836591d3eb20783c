"""Section b of the check: the test suite's GPU tests (``pytest -m gpu``) in a subprocess with a
time limit, read back from pytest's JUnit XML; in the reduced check only their collection
(``--collect-only``), which shows the marks exist where no GPU can run them.

Test modules that cannot be imported on the machine (those that need PyTriton or tritonclient,
which the GPU machine lacks) are collection errors: they are counted and named, and the other
modules' GPU tests still run (``--continue-on-collection-errors``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["run_gpu_tests", "parse_junit", "parse_collect_only"]

TAIL_CHARS = 3000
"""How much of pytest's output the report keeps."""


def _run(cmd: list[str], cwd: Path, timeout_s: float) -> tuple[int | None, str, float]:
    """``(returncode or None on a timeout, output, seconds)``; on a timeout the whole process group
    is killed (pytest may have started processes of its own)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=str(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    return code, out or "", time.perf_counter() - t0


def parse_junit(path: Path) -> dict[str, object]:
    """Counts and the failing tests' ids from a JUnit XML file pytest wrote. A module that could not
    be imported is a collection error, named with its reason, apart from the tests' own errors."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    failing, erroring, uncollected = [], [], []
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        error = case.find("error")
        if case.find("failure") is not None:
            failing.append(test_id)
        elif error is not None and error.get("message") == "collection failure":
            lines = [x[1:].strip() for x in (error.text or "").splitlines() if x.startswith("E ")]
            uncollected.append({"module": case.get("name", ""), "reason": lines[-1] if lines else ""})
        elif error is not None:
            erroring.append(test_id)
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"] - len(uncollected),
        "skipped": counts["skipped"],
        "failing": failing,
        "erroring": erroring,
        "collection_errors": uncollected,
    }


_COLLECTED = re.compile(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?")
_ERROR_COLLECTING = re.compile(r"ERROR collecting (\S+)")


def parse_collect_only(output: str) -> dict[str, object]:
    """What ``pytest --collect-only -q`` printed: the ids it selected, and the modules it could not
    import with the reason (the last ``E`` line of each one's report)."""
    lines = output.splitlines()
    ids = [x.strip() for x in lines if "::" in x and not x.startswith(("ERROR", "E "))]
    errors: dict[str, str] = {}
    module = None
    for x in lines:
        m = _ERROR_COLLECTING.search(x)
        if m:
            module = m.group(1)
            errors[module] = ""
        elif module is not None and x.startswith("E "):
            errors[module] = x[1:].strip()
    for x in lines:  # the short summary names every module, those without a report too
        if x.startswith("ERROR "):
            errors.setdefault(x[len("ERROR ") :].split(" ")[0], "")
    m = _COLLECTED.search(output)
    return {
        "collected": len(ids),
        "total": int(m.group(2) or m.group(1)) if m else None,
        "deselected": int(m.group(3)) if m and m.group(3) else 0,
        "ids": ids,
        "collection_errors": [{"module": k, "reason": v} for k, v in errors.items()],
    }


def run_gpu_tests(root: Path, collect_only: bool, timeout_s: float) -> dict[str, object]:
    """``pytest -m gpu`` over ``root/tests`` (only collected with ``collect_only``)."""
    tests = root / "tests"
    if not tests.is_dir():
        return {"ran": False, "reason": f"no tests folder at {tests} (the check runs from a source tree)"}
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    if collect_only:
        cmd = [*base, "--collect-only", "tests"]
        code, out, seconds = _run(cmd, root, timeout_s)
        report: dict[str, object] = {"ran": True, "mode": "collect-only", **parse_collect_only(out)}
    else:
        with tempfile.TemporaryDirectory(prefix="aligner-gpu-check-") as tmp:
            junit = Path(tmp) / "junit.xml"
            cmd = [*base, "--continue-on-collection-errors", f"--junitxml={junit}", "-rfE", "tests"]
            code, out, seconds = _run(cmd, root, timeout_s)
            report = {"ran": True, "mode": "run"}
            if junit.is_file():
                report.update(parse_junit(junit))
            else:
                report["reason"] = "pytest wrote no JUnit report (timed out or crashed before the end)"
    report.update(
        command=" ".join(cmd[1:]),
        returncode=code,
        timed_out=code is None,
        timeout_s=timeout_s,
        seconds=round(seconds, 2),
        tail=out[-TAIL_CHARS:],
    )
    return report
