"""The image both recipes run (Dockerfile: its base, the torch pin, the entry points, ports and
entrypoint the manifests rely on), and docs/launching.md: linked, its sections present, the files
it names real and the Hydra keys in its commands real keys of each entry point.
"""

from __future__ import annotations

import json
import re
import shlex

from _recipes import ACTOR_ENTRY, CRITIC_ENTRY, ROOT, compose, critic_config, rendered

# --- Dockerfile -----------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_builds_the_project_on_a_cuda_base_chosen_at_build_time(schemas):
    steps = _dockerfile()
    (first, arg), (second, base) = steps[0], steps[1]
    assert first == "ARG" and arg.startswith("BASE_IMAGE=nvidia/cuda:")
    assert (second, base) == ("FROM", "${BASE_IMAGE}")
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    pyproject = (ROOT / "pyproject.toml").read_text()
    low = re.search(r'"torch>=([^,"]+)', pyproject).group(1)
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "Makefile").read_text()).group(1)
    assert pin.startswith(low), "make setup installs the lower bound of pyproject.toml's torch range"
    assert args["TORCH_VERSION"] == pin, "the image's torch must be the one make setup installs"
    runs = " ; ".join(a for i, a in steps if i == "RUN")
    # The default command serves: the image installs the server extra (PyTriton).
    assert '"torch==${TORCH_VERSION}"' in runs and 'pip install ".[server]"' in runs
    assert "pip install --no-deps ." in runs
    assert "python3-dev" in runs and "tini" in runs

    # Both entry points and the package (which carries their configs) are in the image's working directory.
    workdir = next(a for i, a in steps if i == "WORKDIR")
    copied = {a.split()[0] for i, a in steps if i == "COPY"}
    assert {"aligner", "servers", "examples", "pyproject.toml"} <= copied
    for script in (CRITIC_ENTRY, ACTOR_ENTRY):
        assert script.split("/")[0] in copied and (ROOT / script).is_file()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not copied & set(ignored), "a copied path is excluded from the build context"

    entrypoint = json.loads(next(a for i, a in steps if i == "ENTRYPOINT"))
    assert entrypoint[0] == "/usr/bin/tini" and entrypoint[-1] == "--"
    cmd = json.loads(next(a for i, a in steps if i == "CMD"))
    assert cmd[:2] == ["python", CRITIC_ENTRY]
    cfg = critic_config(cmd[2:])
    exposed = {int(p) for i, a in steps if i == "EXPOSE" for p in a.split()}
    assert exposed == {cfg.server.grpc_port, cfg.server.metrics_port} and cfg.server.http_port is None
    assert cfg.server.host == "0.0.0.0"
    # The cache PyTriton writes its workspace into is the variable the server reads.
    env_line = " ".join(a for i, a in steps if i == "ENV")
    assert (
        "XDG_CACHE_HOME=" in env_line and '"XDG_CACHE_HOME"' in (ROOT / "aligner/critic/host.py").read_text()
    )
    # Relative script paths in the manifests run from the image's working directory.
    for d in rendered():
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert "workingDir" not in c, f"{c['name']}: keep the image's WORKDIR {workdir}"


# --- docs -----------------------------------------------------------------------------------------


def test_launch_docs_exist_are_linked_and_name_real_files(schemas):
    doc = ROOT / "docs" / "launching.md"
    text = doc.read_text()
    assert "docs/launching.md" in (ROOT / "README.md").read_text()
    for heading in ("one machine", "SLURM", "Kubernetes", "resum"):
        assert re.search(rf"^#+ .*{heading}", text, re.I | re.M), f"no section on {heading}"
    paths = set(re.findall(r"\b((?:examples|servers|configs|aligner|docs)/[\w./-]+\.\w+)", text))
    assert paths, "the page names no files"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/launching.md names files that do not exist: {missing}"
    # Commands in the page's code blocks use only real Hydra keys.
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if CRITIC_ENTRY in line or ACTOR_ENTRY in line:
                words = shlex.split(line.split("#")[0])
                entry = CRITIC_ENTRY if CRITIC_ENTRY in words else ACTOR_ENTRY
                overrides = [w for w in words[words.index(entry) + 1 :] if "=" in w and not w.startswith("-")]
                overrides = [o for o in overrides if "$" not in o and "<" not in o]
                if entry == CRITIC_ENTRY:
                    critic_config(overrides)
                else:
                    compose("actor", overrides)
