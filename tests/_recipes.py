"""Helpers shared by the launch-recipe tests (tests/recipes/): the Kubernetes manifests as
examples/k8s/render.py renders them, the pieces of a rendered pod, each entry point's checked config
for a command line's Hydra overrides, torchrun's own parse of its arguments, the critic's and the
actor's pod checks both the manifest tests and the layout tests run, and stand-in ``srun`` /
``scontrol`` / ``python`` commands under which the SLURM script records what it launches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import yaml
from _examples import load

from aligner.critic import wait as wait_cli
from aligner.wire import client as critic_client
from aligner.wire import readiness
from aligner.wire.tls import ClientTLS

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "examples" / "k8s"
SBATCH = ROOT / "examples" / "slurm" / "ppo_hetjob.sbatch"
CRITIC_ENTRY = "servers/serve_critic.py"
ACTOR_ENTRY = "examples/train_actor.py"
SHARED_VOLUME = "shared"
# What the Kubeflow training operator puts into every PyTorchJob pod (all its versions).
OPERATOR_ENV = {"RANK": "1", "MASTER_ADDR": "run-actor-master-0", "MASTER_PORT": "23456"}


render = load("k8s", "render")


# --- rendering and config helpers ------------------------------------------------------------------


def rendered(*sets: str, files: tuple = ()) -> list[dict]:
    """The objects ``render.py [-f files] [--set ...]`` prints."""
    text = render.render(render.load_values(list(files), list(sets)))
    return [d for d in yaml.safe_load_all(text) if d]


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    """The one object of ``kind`` (of that ``app.kubernetes.io/component``, where given)."""
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def container(pod_spec: dict, name: str, init: bool = False) -> dict:
    group = pod_spec["initContainers" if init else "containers"]
    found = [c for c in group if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r} in {[c['name'] for c in group]}"
    return found[0]


def env_of(c: dict) -> dict[str, str]:
    """A container's plain environment variables (those with a value)."""
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def secret_env_of(c: dict) -> dict[str, tuple[str, str]]:
    """A container's variables taken from Secrets: name -> (Secret, key)."""
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def secret_files_of(docs: list[dict], pod_spec: dict, c: dict) -> dict[str, tuple[str, str]]:
    """The files a container reads from Secrets: path -> (Secret, key), under its mount path each
    of a Secret volume's ``items`` (at the item's path), or without items every key of the Secret
    (a rendered one; one not rendered here is taken to hold a ``token``)."""
    vols = {v["name"]: v for v in pod_spec.get("volumes", [])}
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    out = {}
    for m in c.get("volumeMounts", []):
        src = vols[m["name"]].get("secret")
        if src is None:
            continue
        assert m.get("readOnly") is True, f"{c['name']}: Secret volume {m['name']} mounted writable"
        name = src["secretName"]
        if "items" in src:
            files = {i["path"]: i["key"] for i in src["items"]}
        else:
            files = {key: key for key in (secrets[name]["stringData"] if name in secrets else {"token": ""})}
        for path, key in files.items():
            out[f"{m['mountPath'].rstrip('/')}/{path}"] = (name, key)
    return out


def stand_in_secret_value(key: str) -> str:
    """What a test puts in the file of a Secret it did not render (a Secret of the user's own):
    a PEM block for a certificate or a key (the roles' TLS checks read its '-----BEGIN' line),
    else a token."""
    if key.endswith((".crt", ".key")):
        kind = "CERTIFICATE" if key.endswith(".crt") else "PRIVATE KEY"
        return f"-----BEGIN {kind}-----\nc3RhbmQtaW4=\n-----END {kind}-----\n"
    return "a-token-from-elsewhere-0123"


def mounted_secret_copies(docs: list[dict], pod_spec: dict, c: dict, tmp: Path) -> dict[str, str]:
    """Each path of a mounted Secret's file in the container -> a file under ``tmp`` holding what
    the kubelet would put there (the Secret's value, or :func:`stand_in_secret_value`)."""
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    mapping = {}
    for path, (name, key) in secret_files_of(docs, pod_spec, c).items():
        local = tmp / name / key
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(secrets[name]["stringData"][key] if name in secrets else stand_in_secret_value(key))
        mapping[path] = str(local)
    return mapping


def with_mounted_secrets(args: list[str], docs: list[dict], pod_spec: dict, c: dict, tmp: Path) -> list[str]:
    """``args`` with each path of a mounted Secret's file replaced by a file under ``tmp`` holding
    what the kubelet would put there (the Secret's value), so that the entry points' config checks,
    which read those files, run as in the pod."""
    mapping = mounted_secret_copies(docs, pod_spec, c, tmp)
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        out.append(f"{key}={mapping[value]}" if eq and value in mapping else a)
    return out


def expand_k8s(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args; every reference must be defined."""

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"{arg!r} refers to $({m.group(1)}), which the pod does not define"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def torchrun(args: list[str]):
    """torchrun's own parse of ``args`` (what follows 'torchrun' or '-m torch.distributed.run')."""
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(args)


def compose(config: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
        return hydra_compose(config, overrides=list(overrides))


def critic_config(overrides: list[str]):
    """The server's checked config for these command-line overrides (unknown keys, wrong types and
    inconsistent values fail here as they fail the server)."""
    from aligner.critic.config import build_config

    return build_config(compose("critic", overrides))


def actor_config(overrides: list[str], world_size: int):
    """The actor's checked config for these overrides at this world size."""
    from omegaconf import OmegaConf

    from aligner.actor.config import validate_actor_config
    from aligner.tokenizers import build_tokenizer

    cfg = OmegaConf.to_object(compose("actor", overrides))
    validate_actor_config(
        cfg, world_size=world_size, vocab_size=build_tokenizer(cfg.tokenizer, cfg.init_from).vocab_size
    )
    return cfg


def resolve_port(pod_container: dict, port) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in pod_container.get("ports", [])}
    assert port in named, f"port {port!r} is not a named port of container {pod_container['name']}"
    return named[port]


def shared_mount(pod_spec: dict, c: dict) -> tuple[str, str]:
    """(claim name, mount path) of the shared volume in this pod."""
    vols = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    return vols[SHARED_VOLUME]["persistentVolumeClaim"]["claimName"], mounts[SHARED_VOLUME]


def assert_dev_shm_in_memory(pod_spec: dict, c: dict) -> None:
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts, f"{c['name']}: /dev/shm is not mounted"
    vol = {v["name"]: v for v in pod_spec["volumes"]}[mounts["/dev/shm"]]
    assert vol["emptyDir"]["medium"] == "Memory"


# --- the critic -----------------------------------------------------------------------------------


def critic_parts(docs: list[dict]):
    dep, svc = one(docs, "Deployment"), one(docs, "Service", "critic")
    pod = dep["spec"]["template"]["spec"]
    c = container(pod, "critic")
    assert c["args"][0] == "torchrun", (
        "the critic's args start with torchrun (the image's entrypoint is tini)"
    )
    tr = torchrun(c["args"][1:])
    assert tr.training_script == CRITIC_ENTRY and (ROOT / tr.training_script).is_file()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = critic_config(with_mounted_secrets(tr.training_script_args, docs, pod, c, Path(tmp)))
    return dep, svc, pod, c, tr, cfg


# --- the actor ------------------------------------------------------------------------------------


def split_secret_files(docs: list[dict], pod_spec: dict, c: dict) -> tuple[dict, dict]:
    """A container's Secret files (:func:`secret_files_of`): (those of rendered Secrets, the run
    token's; those of Secrets of the user's own, as the TLS one)."""
    rendered_names = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    files = secret_files_of(docs, pod_spec, c)
    own = {p: ref for p, ref in files.items() if ref[0] in rendered_names}
    return own, {p: ref for p, ref in files.items() if p not in own}


def client_tls_of(args) -> ClientTLS:
    """The TLS settings of ``aligner.critic.wait`` or ``aligner.critic.probe`` parsed args."""
    return ClientTLS(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)


def tls_paths(tls) -> set[str]:
    """The files a ClientTLS or ServerTLSConfig names."""
    keys = ("ca_file", "cert_file", "key_file", "client_ca_file")
    return {getattr(tls, k) for k in keys if getattr(tls, k, None)}


def check_actor_pod(docs: list[dict], pod: dict, name: str, operator_env: dict[str, str] | None = None):
    """Checks shared by the Job and the PyTorchJob; returns (torchrun args, actor config). With
    the critic's TLS on (tls_secret), the URL is grpcs and each container mounts exactly the TLS
    files its settings name (the wait's --tls-* flags, the actor's critic.tls), which pass the
    entry points' own TLS checks."""
    svc = one(docs, "Service", "critic")
    critic_cfg = critic_parts(docs)[-1]

    # Waiting for the server: the readiness CLI, with the URL the actor will use.
    wait = container(pod, "wait-for-critic", init=True)
    assert wait["args"][:3] == ["python", "-m", "aligner.critic.wait"]
    assert importlib.util.find_spec(wait["args"][2]) is not None
    wait_args = wait_cli._parser().parse_args(wait["args"][3:])
    assert wait_args.timeout >= 60

    c = container(pod, name)
    critic_pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    critic_token = split_secret_files(docs, critic_pod, container(critic_pod, "critic"))[0]
    for cont in (wait, c):
        env = env_of(cont)
        assert set(env) == {critic_client.ENV_URL}, f"{cont['name']}: env {sorted(env)}"
        # The actor writes with the run token of the critic's Secret, read from the same file
        # path; waiting needs none. No token in any environment.
        assert secret_env_of(cont) == {}
        want = critic_token if cont is c else {}
        token, tls_files = split_secret_files(docs, pod, cont)
        assert token == want and len(want) == (1 if cont is c else 0)
        if not critic_cfg.server.tls.on:
            assert tls_files == {}, f"{cont['name']}: TLS files without TLS on"
        elif cont is wait:  # the actor's files are checked against its config below
            assert set(tls_files) == tls_paths(client_tls_of(wait_args)), "mounted = named by --tls-*"
        url = env[critic_client.ENV_URL]
        scheme, hostport = readiness.parse_url(url)
        host, port = hostport.rsplit(":", 1)
        svc_ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        assert (scheme, host, int(port)) == (
            critic_cfg.server.tls.scheme,
            svc["metadata"]["name"],
            svc_ports["grpc"],
        )
        assert int(port) == critic_cfg.server.grpc_port
    with tempfile.TemporaryDirectory() as tmp:  # the wait's own check of its URL and TLS files
        local = mounted_secret_copies(docs, pod, wait, Path(tmp))
        named = client_tls_of(wait_args)
        ClientTLS(*(local[p] if p else None for p in (named.ca_file, named.cert_file, named.key_file))).check(
            env_of(wait)[critic_client.ENV_URL], scheme, prefix="--tls"
        )

    args = [expand_k8s(a, {**env_of(c), **(operator_env or {})}) for a in c["args"]]
    assert args[0] == "torchrun"
    tr = torchrun(args[1:])
    assert tr.training_script == ACTOR_ENTRY and (ROOT / tr.training_script).is_file()
    nproc = int(tr.nproc_per_node)
    nnodes = int(tr.nnodes.split(":")[-1])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = actor_config(
            with_mounted_secrets(tr.training_script_args, docs, pod, c, Path(tmp)), world_size=nnodes * nproc
        )
        # The client's check of critic.tls against the URL (grpcs:// with it, none without),
        # while the mounted files are there to read.
        cfg.critic.tls.check(env_of(c)[critic_client.ENV_URL], scheme)
        in_pod = {local: path for path, local in mounted_secret_copies(docs, pod, c, Path(tmp)).items()}
    if critic_cfg.server.tls.on:
        assert set(split_secret_files(docs, pod, c)[1]) == {
            in_pod.get(p, p) for p in tls_paths(cfg.critic.tls)
        }
    assert c["resources"]["limits"]["nvidia.com/gpu"] == nproc

    # No critic.url on the command line: the actor reads the Service's address from the environment.
    assert cfg.critic.url is None
    old = os.environ.get(critic_client.ENV_URL)
    os.environ[critic_client.ENV_URL] = env_of(c)[critic_client.ENV_URL]
    try:
        assert critic_client.resolve_critic_url(cfg.critic.url) == env_of(c)[critic_client.ENV_URL]
    finally:
        if old is None:
            del os.environ[critic_client.ENV_URL]
        else:
            os.environ[critic_client.ENV_URL] = old

    # Both roles save into, and resume from, one folder on one shared volume.
    critic_pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    critic_claim, critic_mount = shared_mount(critic_pod, container(critic_pod, "critic"))
    claim, mount = shared_mount(pod, c)
    pvc = one(docs, "PersistentVolumeClaim")
    assert claim == critic_claim == pvc["metadata"]["name"] and mount == critic_mount
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "the two roles run on different nodes"
    assert cfg.checkpoint.dir == critic_cfg.checkpoint.dir
    assert cfg.checkpoint.dir.startswith(mount.rstrip("/") + "/")
    assert critic_cfg.log.dir.startswith(mount) and cfg.logging.run_dir.startswith(mount)
    assert cfg.checkpoint.resume == "auto", "a rescheduled pod must resume with the same command"
    assert cfg.checkpoint.save_interval > 0
    assert_dev_shm_in_memory(pod, c)
    assert pod["nodeSelector"] == critic_pod["nodeSelector"]
    return tr, cfg


# --- SLURM ----------------------------------------------------------------------------------------

_STUB = """#!{python}
import json, os, signal, sys, time
log = os.environ["STUB_LOG"]
def record(**kw):
    with open(log, "a") as f:
        f.write(json.dumps(kw) + "\\n")
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
if name == "scontrol":
    print("\\n".join(args[2].split(",")))
    sys.exit(0)
role = "critic" if "{critic}" in args else "actor" if "{actor}" in args else "other"
if any("aligner.rollout.worker" in a for a in args):
    role = "rollout"
def on_term(*_):
    record(event="TERM", role=role)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
record(event="start", cmd=name, role=role, args=args, pid=os.getpid(),
       url=os.environ.get("ALIGNER_CRITIC_URL"))
if args[:2] == ["-m", "aligner.critic.wait"]:
    # As the real check does, return once the server is up (here: once its stub has started).
    deadline = time.time() + 30
    while time.time() < deadline and '"role": "critic"' not in open(log).read():
        time.sleep(0.01)
if role == "actor" and name == "srun" and os.environ.get("ROLLOUT_WORKERS_PER_NODE", "0") != "0":
    # A real actor outlives its workers' start; this one ends at once, and the script's SIGTERM
    # at its end must not reach the workers' step before that step's stub has started.
    deadline = time.time() + 30
    while time.time() < deadline and '"role": "rollout"' not in open(log).read():
        time.sleep(0.01)
blocks = role == "critic" or (role == "rollout" and name == "srun")  # until stopped, as they run
if blocks or (role == "actor" and os.environ.get("STUB_ACTOR_BLOCK")):
    deadline = time.time() + 30
    while time.time() < deadline:
        time.sleep(0.05)
    record(event="stub timed out", role=role)
"""


def _slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    body = _STUB.format(python=sys.executable, critic=CRITIC_ENTRY, actor=ACTOR_ENTRY)
    for name in ("srun", "scontrol", "python"):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PATH=f"{stubs}{os.pathsep}{env['PATH']}",
        PYTHON=str(stubs / "python"),
        STUB_LOG=str(tmp_path / "log.jsonl"),
        ALIGNER_REPO=str(ROOT),
        RUN_ROOT=str(tmp_path / "run"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST_HET_GROUP_0="gpu-c01",
        SLURM_JOB_NODELIST_HET_GROUP_1="gpu-a01,gpu-a02",
    )
    env.update(extra)
    return env


def _log(tmp_path: Path) -> list[dict]:
    path = tmp_path / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _after(args: list[str], marker: str) -> list[str]:
    return args[args.index(marker) + 2 :]  # what follows '-m <module>'
