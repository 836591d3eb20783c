"""pyproject.toml's dependencies are ranges a user's environment can satisfy, and their lower bounds
are the versions `make test-lowest` installs and tests (constraints/lowest.txt): the two cannot
drift apart. PyTriton and the numpy < 2 it forces belong to the server extra only, and the dev
extra (what `make setup` installs) includes that extra. No install: the files are read as text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOWEST = ROOT / "constraints" / "lowest.txt"

tomllib = pytest.importorskip("tomllib")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(specs: list[str]) -> list[Requirement]:
    return [Requirement(s) for s in specs]


def _lower_bound(req: Requirement) -> str | None:
    bounds = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert len(bounds) <= 1, f"{req}: one lower bound"
    return bounds[0] if bounds else None


def _lowest() -> dict[str, str]:
    pins = {}
    for line in LOWEST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints/lowest.txt: {line!r} is not name==version"
            pins[name.strip().lower()] = version.strip()
    return pins


def _tested() -> list[Requirement]:
    """The requirements whose lower bounds make test-lowest installs: the main ones and the server extra's."""
    project = _project()
    return _requirements(project["dependencies"] + project["optional-dependencies"]["server"])


def test_every_lower_bound_is_the_version_make_test_lowest_installs():
    pins = _lowest()
    seen = set()
    for req in _tested():
        name = req.name.lower()
        low = _lower_bound(req)
        assert low is not None, f"{req}: every dependency has a tested lower bound"
        if name in seen:  # numpy: the main range and the server extra's cap share one lower bound
            assert Version(pins[name]) == Version(low), f"{req}: lower bound {low}, lowest.txt {pins[name]}"
            continue
        seen.add(name)
        assert name in pins, f"{req}: no line for {name} in constraints/lowest.txt"
        assert Version(pins[name]) == Version(low), (
            f"{name}: pyproject.toml's lower bound is {low}, constraints/lowest.txt installs {pins[name]}"
        )
        assert req.specifier.contains(pins[name], prereleases=True)
    assert set(pins) == seen, f"constraints/lowest.txt pins what pyproject.toml does not: {set(pins) - seen}"


def test_no_main_dependency_is_pinned_to_one_release():
    for req in _requirements(_project()["dependencies"]):
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{req}: a range, not a pin"
        # A range that admits more than its lower bound: at least the next minor release.
        low = Version(_lower_bound(req))
        assert req.specifier.contains(
            f"{low.major}.{low.minor + 1}", prereleases=True
        ) or req.specifier.contains(f"{low.major}.{low.minor}.{low.micro + 1}", prereleases=True), (
            f"{req}: admits only its lower bound"
        )


def test_numpy_below_2_and_pytriton_are_the_server_extras_only():
    project = _project()
    extras = project["optional-dependencies"]
    main = {r.name.lower(): r for r in _requirements(project["dependencies"])}
    assert "nvidia-pytriton" not in main, "PyTriton is the server's: the actor needs only tritonclient"
    assert main["numpy"].specifier.contains("2.2.0"), "the main dependencies admit numpy 2"
    assert "tritonclient" in main and {"grpc"} <= set(main["tritonclient"].extras)
    for extra, specs in extras.items():
        for req in _requirements(specs):
            if req.name.lower() == "numpy" and not req.specifier.contains("2.0.0"):
                assert extra == "server", f"numpy<2 in the {extra} extra: keep it to the server extra"
    server = {r.name.lower(): r for r in _requirements(extras["server"])}
    assert "nvidia-pytriton" in server
    assert not server["numpy"].specifier.contains("2.0.0"), "PyTriton 0.7 requires numpy < 2"
    # make setup installs .[dev]: the server extra comes with it, so the suite's servers can start.
    dev = [Requirement(s) for s in extras["dev"]]
    assert any(r.name == project["name"] and "server" in r.extras for r in dev)


def test_make_test_lowest_installs_the_constraints_and_ci_runs_it_after_make_test():
    makefile = (ROOT / "Makefile").read_text()
    target = re.search(r"^test-lowest:.*?(?=^\S|\Z)", makefile, re.M | re.S)
    assert target, "no test-lowest target"
    recipe = target.group(0) + makefile  # the recipe's variables are defined elsewhere in the Makefile
    assert "constraints/lowest.txt" in recipe and '"torch==' in recipe
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci and "make test-lowest" in ci
    assert ci.index("make test-lowest") > ci.index("make test")


def test_the_actor_never_imports_pytriton():
    """Only the server's module imports PyTriton, and only inside the function that starts Triton."""
    for path in (ROOT / "aligner").rglob("*.py"):
        text = path.read_text()
        if re.search(r"^\s*(from|import) pytriton", text, re.M):
            assert path.relative_to(ROOT).as_posix() == "aligner/critic/server.py", path
            assert not re.search(r"^(from|import) pytriton", text, re.M), (
                f"{path}: a top-level PyTriton import"
            )


@pytest.mark.subprocess
def test_the_server_without_pytriton_names_the_server_extra(tmp_path):
    """Where PyTriton is not installed (the package without its server extra), the server's entry
    point stops at once with exit code 2 and says what to install."""
    import os
    import subprocess
    import sys

    hide = (
        "import sys; sys.modules['pytriton'] = None; from aligner.critic.server import main; sys.exit(main())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", hide, f"log.dir={tmp_path / 'log'}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "READY" not in proc.stdout
    assert "pip install 'aligner-rlhf[server]'" in proc.stderr, proc.stderr[-2000:]

    from aligner.critic import server

    assert server.pytriton_missing() is None  # here the server extra is installed
