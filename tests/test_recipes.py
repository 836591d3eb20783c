"""Launch recipes (examples/k8s, examples/slurm, Dockerfile, docs/launching.md) against the code.

The Kubernetes manifests are rendered exactly as a user renders them (examples/k8s/render.py),
validated against the Kubernetes API schema (kubernetes-validate ships it; no cluster), and their
ports, probe paths, environment names and command lines are checked against what the entry
points read and serve: every Hydra override is composed with the entry point's own structured
schema and checked as the entry point checks it, torchrun's arguments are parsed by torchrun's own
parser. The SLURM script runs under stand-in ``srun``/``scontrol`` commands that record what it
launches. One test starts a real server for the readiness CLI and the probe paths.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import jsonschema
import kubernetes_validate
import pytest
import yaml
from _examples import load
from hydra.errors import ConfigCompositionException

from aligner.config_checks import ConfigError
from aligner.critic import launch
from aligner.critic import wait as wait_cli
from aligner.wire import client as critic_client
from aligner.wire import protocol as P
from aligner.wire import readiness

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "examples" / "k8s"
SBATCH = ROOT / "examples" / "slurm" / "ppo_hetjob.sbatch"
CRITIC_ENTRY = "servers/serve_critic.py"
ACTOR_ENTRY = "examples/train_actor.py"
SHARED_VOLUME = "shared"
# The Kubernetes versions the manifests must be valid for: an older one still in service and the
# newest the package knows.
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())
# Triton's KServe v2 health endpoints (served on the HTTP port).
TRITON_HEALTH = {"ready": "/v2/health/ready", "live": "/v2/health/live"}
# What the Kubeflow training operator puts into every PyTorchJob pod (all its versions).
OPERATOR_ENV = {"RANK": "1", "MASTER_ADDR": "run-actor-master-0", "MASTER_PORT": "23456"}


render = load("k8s", "render")


# --- rendering and config helpers ------------------------------------------------------------------


def rendered(*sets: str, files: tuple = ()) -> list[dict]:
    """The objects ``render.py [-f files] [--set ...]`` prints."""
    text = render.render(render.load_values(list(files), list(sets)))
    return [d for d in yaml.safe_load_all(text) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
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


@pytest.fixture(scope="module")
def schemas():
    """Register each entry point's structured config schema, as running it does (both scripts
    forward to these modules)."""
    import aligner.actor.run  # noqa: F401
    import aligner.critic.server  # noqa: F401


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


# --- schema validation ----------------------------------------------------------------------------

# The fields of the training operator's PyTorchJob CRD (kubeflow.org/v1) that sit outside the pod
# templates; the templates themselves are checked as Kubernetes PodTemplateSpecs.
PYTORCHJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["pytorchReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "elasticPolicy": {"type": "object"},
                "nprocPerNode": {"type": "string"},
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "activeDeadlineSeconds": {"type": "integer"},
                        "backoffLimit": {"type": "integer"},
                        "cleanPodPolicy": {"enum": ["None", "Running", "All"]},
                        "managedBy": {"type": "string"},
                        "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"},
                        "ttlSecondsAfterFinished": {"type": "integer"},
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["Master"],
                    "properties": {
                        role: {
                            "type": "object",
                            "required": ["replicas", "template"],
                            "additionalProperties": False,
                            "properties": {
                                "replicas": {"type": "integer", "minimum": 1},
                                "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                                "template": {"type": "object"},
                            },
                        }
                        for role in ("Master", "Worker")
                    },
                },
            },
        },
    },
}


def validate(doc: dict) -> None:
    """Against the Kubernetes API schema (strict: unknown fields are errors) of each version."""
    if doc["kind"] == "PyTorchJob":
        jsonschema.validate(doc, PYTORCHJOB_SCHEMA)
        docs = [
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"},
                "template": spec["template"],
            }
            for role, spec in doc["spec"]["pytorchReplicaSpecs"].items()
        ]
    else:
        docs = [doc]
    for d in docs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                raise AssertionError(f"{d['kind']} {d['metadata']['name']} at {path}: {e.message}") from None


@pytest.mark.parametrize("nodes", [1, 3])
def test_every_manifest_is_valid_for_the_kubernetes_api(nodes):
    docs = rendered(f"actor_nodes={nodes}")
    kinds = [d["kind"] for d in docs]
    actor_kind = "Job" if nodes == 1 else "PyTorchJob"
    assert kinds == ["Secret", "PersistentVolumeClaim", "Service", "Deployment", "NetworkPolicy", actor_kind]
    for d in docs:
        validate(d)
        assert d["metadata"]["namespace"] == "default"


def test_a_values_file_of_your_own_changes_what_it_names(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        textwrap.dedent(
            """\
            run_name: exp2
            namespace: rlhf
            image: registry.example.com/team/aligner:1.2
            storage_class: cephfs
            critic_data_parallel: 2
            node_selector: {pool: h100}
            policy_path: /shared/models/policy
            """
        )
    )
    docs = rendered(files=(mine,))
    for d in docs:
        validate(d)
        assert d["metadata"]["name"].startswith("exp2-") and d["metadata"]["namespace"] == "rlhf"
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "cephfs"
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(pod, "critic")
    assert c["image"] == "registry.example.com/team/aligner:1.2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2 and pod["nodeSelector"] == {"pool": "h100"}
    actor = container(one(docs, "Job")["spec"]["template"]["spec"], "actor")
    assert "init_from=/shared/models/policy" in actor["args"]


# --- the critic -----------------------------------------------------------------------------------


def critic_parts(docs: list[dict]):
    dep, svc = one(docs, "Deployment"), one(docs, "Service")
    pod = dep["spec"]["template"]["spec"]
    c = container(pod, "critic")
    assert c["args"][0] == "torchrun", (
        "the critic's args start with torchrun (the image's entrypoint is tini)"
    )
    tr = torchrun(c["args"][1:])
    assert tr.training_script == CRITIC_ENTRY and (ROOT / tr.training_script).is_file()
    return dep, svc, pod, c, tr, critic_config(tr.training_script_args)


def test_critic_ports_probes_and_service_match_what_the_server_serves(schemas):
    dep, svc, pod, c, tr, cfg = critic_parts(rendered())
    assert cfg.server.host == "0.0.0.0", "server.host must let the Service reach the server"
    served = {"http": cfg.server.http_port, "grpc": cfg.server.grpc_port, "metrics": cfg.server.metrics_port}
    assert all(served.values()), f"fixed ports are needed behind a Service, got {served}"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == served

    # The Service: named gRPC and HTTP ports that lead to the server's.
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert {"grpc", "http"} <= set(ports)
    for name, p in ports.items():
        assert resolve_port(c, p["targetPort"]) == served[name]
        assert p["port"] == served[name], "clients dial the server's own port numbers"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()

    # Probes: Triton's health endpoints, on the HTTP port.
    assert c["readinessProbe"]["httpGet"]["path"] == TRITON_HEALTH["ready"]
    assert c["livenessProbe"]["httpGet"]["path"] == TRITON_HEALTH["live"]
    assert c["startupProbe"]["httpGet"]["path"] in TRITON_HEALTH.values()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert resolve_port(c, c[probe]["httpGet"]["port"]) == cfg.server.http_port
    # The readiness the launcher and the actor's client wait for is the same endpoint.
    assert TRITON_HEALTH["ready"] in Path(readiness.__file__).read_text()
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == cfg.server.metrics_port


def test_critic_gpus_parallelism_and_graceful_stop(schemas):
    dep, svc, pod, c, tr, cfg = critic_parts(rendered("critic_tensor_parallel=2", "critic_data_parallel=2"))
    assert tr.nproc_per_node == "4" and tr.standalone
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.data_parallel_size) == (2, 2)
    assert p.world_size_problem(4) is None, "the critic's processes must be its TP x DP"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    # SIGTERM saves the critic; torchrun waits --shutdown-timeout for it, inside the grace period.
    assert cfg.checkpoint.save_on_sigterm and cfg.checkpoint.resume == "auto"
    assert tr.shutdown_timeout is not None
    assert pod["terminationGracePeriodSeconds"] > tr.shutdown_timeout >= 60
    assert_dev_shm_in_memory(pod, c)


# --- the actor ------------------------------------------------------------------------------------


def check_actor_pod(docs: list[dict], pod: dict, name: str, operator_env: dict[str, str] | None = None):
    """Checks shared by the Job and the PyTorchJob; returns (torchrun args, actor config)."""
    svc = one(docs, "Service")
    critic_cfg = critic_parts(docs)[-1]

    # Waiting for the server: the readiness CLI, with the URL the actor will use.
    wait = container(pod, "wait-for-critic", init=True)
    assert wait["args"][:3] == ["python", "-m", "aligner.critic.wait"]
    assert importlib.util.find_spec(wait["args"][2]) is not None
    wait_args = wait_cli._parser().parse_args(wait["args"][3:])
    assert wait_args.timeout >= 60

    c = container(pod, name)
    for cont in (wait, c):
        env = env_of(cont)
        assert set(env) == {critic_client.ENV_URL}, f"{cont['name']}: env {sorted(env)}"
        # The actor writes with the run token of the critic's Secret; waiting needs none.
        critic_token = secret_env_of(container(one(docs, "Deployment")["spec"]["template"]["spec"], "critic"))
        want = critic_token if cont is c else {}
        assert secret_env_of(cont) == want and set(want) == ({P.RUN_TOKEN_ENV} if want else set())
        url = env[critic_client.ENV_URL]
        scheme, hostport = readiness.parse_url(url)
        host, port = hostport.rsplit(":", 1)
        svc_ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        assert (scheme, host, int(port)) == ("grpc", svc["metadata"]["name"], svc_ports["grpc"])
        assert int(port) == critic_cfg.server.grpc_port

    args = [expand_k8s(a, {**env_of(c), **(operator_env or {})}) for a in c["args"]]
    assert args[0] == "torchrun"
    tr = torchrun(args[1:])
    assert tr.training_script == ACTOR_ENTRY and (ROOT / tr.training_script).is_file()
    nproc = int(tr.nproc_per_node)
    nnodes = int(tr.nnodes.split(":")[-1])
    cfg = actor_config(tr.training_script_args, world_size=nnodes * nproc)
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


def test_actor_job_waits_for_the_critic_and_shares_its_checkpoints(schemas):
    docs = rendered("actor_gpus_per_node=2", "actor_tensor_parallel=2")
    job = one(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    tr, cfg = check_actor_pod(docs, pod, "actor")
    assert tr.standalone and tr.nnodes == "1" and tr.nproc_per_node == "2"
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] >= 1


def test_actor_pytorchjob_on_several_nodes(schemas):
    # 4 nodes x 2 GPUs with TP 2 is 4 data-parallel ranks: the minibatch of 64 is 16 per rank,
    # which the default micro batch (64) does not divide, so the values lower it.
    nodes = ("actor_nodes=4", "actor_gpus_per_node=2", "actor_tensor_parallel=2")
    docs = rendered(*nodes, "actor_overrides=[ppo.micro_batch_size=16]")
    job = one(docs, "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    assert job["spec"]["nprocPerNode"] == "2"
    pod = specs["Master"]["template"]["spec"]
    c = container(pod, "pytorch")  # the operator finds its container by this name
    assert "pytorchjob-port" in {p["name"] for p in c["ports"]}
    tr, cfg = check_actor_pod(docs, pod, "pytorch", operator_env=OPERATOR_ENV)
    assert tr.nnodes == "4" and tr.nproc_per_node == "2"
    assert tr.node_rank == int(OPERATOR_ENV["RANK"]) and tr.master_addr == OPERATOR_ENV["MASTER_ADDR"]
    assert tr.master_port == int(OPERATOR_ENV["MASTER_PORT"])
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.ppo.micro_batch_size == 16
    # The same values without the smaller micro batch break the actor's own batch-size check.
    bad = rendered(*nodes)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        check_actor_pod(
            bad,
            one(bad, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"],
            "pytorch",
            OPERATOR_ENV,
        )


def test_k8s_run_token_secret_and_network_policy_guard_the_critic(schemas):
    """Writes need the run token: one Secret, read by the critic and by every actor pod (Job and
    PyTorchJob) as $ALIGNER_RUN_TOKEN; and only the actor's pods reach the critic's ports."""
    for nodes in (1, 3):
        docs = rendered(f"actor_nodes={nodes}")
        secret = one(docs, "Secret")
        token = secret["stringData"]["token"]
        assert len(token) >= render.MIN_TOKEN_CHARS and secret["immutable"] is True
        ref = (secret["metadata"]["name"], "token")
        dep, svc, critic_pod, c, tr, cfg = critic_parts(docs)
        assert secret_env_of(c) == {P.RUN_TOKEN_ENV: ref}
        # The server reads that variable when its config names no token file.
        assert cfg.server.run_token_file is None
        assert P.resolve_run_token(None, "server.run_token_file", {P.RUN_TOKEN_ENV: token}) == token
        actor = one(docs, "Job" if nodes == 1 else "PyTorchJob")
        pods = (
            [actor["spec"]["template"]]
            if nodes == 1
            else [r["template"] for r in actor["spec"]["pytorchReplicaSpecs"].values()]
        )
        for pod in pods:
            (main,) = pod["spec"]["containers"]
            assert secret_env_of(main) == {P.RUN_TOKEN_ENV: ref}

        policy = one(docs, "NetworkPolicy")
        critic_labels = dep["spec"]["template"]["metadata"]["labels"]
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"].items() <= critic_labels.items()
        assert spec["policyTypes"] == ["Ingress"]
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}, "actor pods by label, nothing else"
        admitted = peer["podSelector"]["matchLabels"]
        for pod in pods:
            assert admitted.items() <= pod["metadata"]["labels"].items()
        assert not admitted.items() <= critic_labels.items()
        ports = {resolve_port(c, p["port"]) for p in rule["ports"]}
        svc_ports = {p["name"]: resolve_port(c, p["targetPort"]) for p in svc["spec"]["ports"]}
        assert ports == {svc_ports["grpc"], svc_ports["http"]} == {cfg.server.grpc_port, cfg.server.http_port}
    # A fresh token per render, unless the values give one.
    assert one(rendered(), "Secret")["stringData"] != one(rendered(), "Secret")["stringData"]
    given = "a-run-token-of-my-own-0123"
    assert one(rendered(f"run_token={given}"), "Secret")["stringData"]["token"] == given


def test_user_overrides_reach_each_role_and_must_be_real_keys(schemas):
    docs = rendered(
        "critic_overrides=[optim.lr=3e-4, model.num_layers=4]", "actor_overrides=[ppo.num_steps=7]"
    )
    assert critic_parts(docs)[-1].optim.lr == 3e-4
    pod = one(docs, "Job")["spec"]["template"]["spec"]
    assert check_actor_pod(docs, pod, "actor")[1].ppo.num_steps == 7
    typo = rendered("actor_overrides=[ppo.num_stpes=7]")
    with pytest.raises(ConfigCompositionException, match="num_stpes"):
        check_actor_pod(typo, one(typo, "Job")["spec"]["template"]["spec"], "actor")


def test_environment_names_in_the_manifests_are_ones_the_code_reads():
    source = "\n".join(
        p.read_text() for d in ("aligner", "servers", "examples") for p in (ROOT / d).rglob("*.py")
    )
    names = set()

    def collect(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("env"), list):
                names.update(e["name"] for e in node["env"])
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    for nodes in (1, 2):
        collect(rendered(f"actor_nodes={nodes}"))
    assert names == {critic_client.ENV_URL, P.RUN_TOKEN_ENV}
    for name in names:
        assert f'"{name}"' in source, f"no code reads ${name}"


# --- the renderer ---------------------------------------------------------------------------------


def test_every_value_is_used_and_every_placeholder_has_a_value():
    defaults = yaml.safe_load(render.DEFAULT_VALUES.read_text())
    used = set()
    for path in K8S.glob("*.yaml"):
        if path.name != "values.yaml":
            used |= set(render.PLACEHOLDER.findall(path.read_text()))
            list(yaml.safe_load_all(path.read_text()))  # templates are YAML before rendering too
    assert used == set(defaults) | set(render.DERIVED)


def test_render_rules_and_errors(tmp_path):
    values = {"a": None, "b": ["x=1", "y=2"], "c": [], "d": 3, "e": {"k": "v"}}
    text = render.render_text(
        'f: ${a}\ng: "${d}"\nh: ${d}\ni: ${e}\nl:\n  - ${b}\n  - ${c}\n  - "z=${a}"\n', values
    )
    assert yaml.safe_load(text) == {"g": "3", "h": 3, "i": {"k": "v"}, "l": ["x=1", "y=2", "z=null"]}
    with pytest.raises(render.RenderError, match=r"\$\{nope\}"):
        render.render_text("x: ${nope}", values)
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_nmae: x\n")
    with pytest.raises(render.RenderError, match="run_nmae"):
        render.load_values([bad])
    for setting, pattern in (
        ("run_name=Not_A_Label", "run_name"),
        ("critic_tensor_parallel=two", "critic_tensor_parallel"),
        ("critic_data_parallel=0", "critic_data_parallel"),
        ("critic_gpus=2", "critic_gpus.*computed"),
        ("actor_tensor_parallel=3", "actor_tensor_parallel"),
        ("actor_pipeline_parallel=2", "actor_pipeline_parallel=2 = 2"),
        ("actor_generation_tensor_parallel=3", "actor_generation_tensor_parallel=3 does not divide"),
        ("actor_generation_tensor_parallel=two", "actor_generation_tensor_parallel"),
        ("storage_class=", "storage_class"),
        ('image=a"b', "image"),
        ("actor_overrides=[lonely]", "actor_overrides"),
        ("run_token=short", "run_token"),
    ):
        with pytest.raises(render.RenderError, match=pattern):
            render.load_values([], [setting])


def test_render_cli_prints_what_you_apply(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("run_name: cli\nrun_token: cli-token-0123456789abcdef\n")
    cmd = [sys.executable, str(K8S / "render.py"), "-f", str(mine), "--set", "actor_nodes=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == render.render(render.load_values([mine], ["actor_nodes=2"]))
    only = subprocess.run(cmd + ["--only", "critic"], capture_output=True, text=True, timeout=60)
    assert [d["kind"] for d in yaml.safe_load_all(only.stdout)] == ["Service", "Deployment", "NetworkPolicy"]
    bad = subprocess.run(cmd + ["--set", "gpus=1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gpus" in bad.stderr


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
if role == "critic" or (role == "actor" and os.environ.get("STUB_ACTOR_BLOCK")):
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


def sbatch_components() -> list[dict[str, str]]:
    """The #SBATCH options of each hetjob component, as {option: value}."""
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    components: list[dict[str, str]] = [{}]
    for line in lines:
        if line.startswith("#SBATCH"):
            opt = line.split(None, 1)[1]
            if opt == "hetjob":
                components.append({})
            else:
                key, _, value = opt.partition("=")
                components[-1][key] = value
    return components


def test_sbatch_script_is_valid_bash_with_two_components():
    check = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    components = sbatch_components()
    assert len(components) == 2, "one critic component, one actor component"
    for component in components:
        assert {"--nodes", "--gpus-per-node", "--cpus-per-task"} <= set(component)
    signal_opt = "--signal=" + components[0]["--signal"]
    assert re.fullmatch(r"--signal=B:TERM@\d+", signal_opt), (
        "SIGTERM to the batch script, which stops both roles"
    )


def test_sbatch_launches_the_critic_then_the_actor_against_it(tmp_path, schemas):
    env = _slurm_env(tmp_path)
    run = subprocess.run(
        ["bash", str(SBATCH), "ppo.num_steps=10", "ppo.micro_batch_size=32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    log = _log(tmp_path)
    starts = {e["role"]: e for e in log if e["event"] == "start"}
    assert len(starts) == 3 == len([e for e in log if e["event"] == "start"])
    critic, wait, actor = starts["critic"], starts["other"], starts["actor"]
    assert (critic["cmd"], wait["cmd"], actor["cmd"]) == ("srun", "python", "srun")
    assert log.index(wait) < log.index(actor), "the actor starts only once the critic is ready"

    # The critic: component 0, torchrun with as many processes as its TP size and its GPUs.
    components = sbatch_components()
    assert "--het-group=0" in critic["args"]
    assert f"--gpus-per-node={components[0]['--gpus-per-node']}" in critic["args"]
    assert f"--cpus-per-task={components[0]['--cpus-per-task']}" in critic["args"]
    tr = torchrun(_after(critic["args"], "-m"))
    assert tr.nproc_per_node == components[0]["--gpus-per-node"]
    assert tr.training_script == CRITIC_ENTRY
    ccfg = critic_config(tr.training_script_args)
    assert ccfg.server.host == "0.0.0.0" and ccfg.checkpoint.save_on_sigterm
    assert int(tr.nproc_per_node) == ccfg.parallel.world_size
    url = f"grpc://gpu-c01:{ccfg.server.grpc_port}"

    # The wait: the readiness CLI, on the critic's address, watching the critic's step.
    assert wait["args"][:2] == ["-m", "aligner.critic.wait"]
    wargs = wait_cli._parser().parse_args(wait["args"][2:])
    assert wargs.url == url and wargs.pid == critic["pid"]

    # The actor: component 1 on both of its nodes, the critic's address from the job, same checkpoints.
    assert "--het-group=1" in actor["args"] and "--nodes=2" in actor["args"]
    assert actor["url"] == url
    assert f"--gpus-per-node={components[1]['--gpus-per-node']}" in actor["args"]
    assert f"--cpus-per-task={components[1]['--cpus-per-task']}" in actor["args"]
    tr = torchrun(_after(actor["args"], "-m"))
    assert tr.training_script == ACTOR_ENTRY and tr.nnodes == "2"
    assert tr.nproc_per_node == components[1]["--gpus-per-node"]
    assert tr.rdzv_endpoint.startswith("gpu-a01:")
    acfg = actor_config(tr.training_script_args, world_size=2 * int(tr.nproc_per_node))
    assert acfg.critic.url is None and acfg.ppo.num_steps == 10
    assert acfg.checkpoint.dir == ccfg.checkpoint.dir == str(tmp_path / "run" / "checkpoints")
    assert acfg.checkpoint.resume == ccfg.checkpoint.resume == "auto"
    # At the end, the critic is stopped with SIGTERM (it saves before it exits).
    assert log[-1] == {"event": "TERM", "role": "critic"}


def test_sbatch_sigterm_stops_the_actor_then_the_critic(tmp_path):
    env = _slurm_env(tmp_path, STUB_ACTOR_BLOCK="1")
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not any(e.get("role") == "actor" for e in _log(tmp_path)):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the actor never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@N sends before the time limit
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    terms = [e["role"] for e in _log(tmp_path) if e["event"] == "TERM"]
    assert terms == ["actor", "critic"]


# --- the parallel layouts the tests run ------------------------------------------------------------


class Layout(NamedTuple):
    """A layout one of the end-to-end tests runs: its process count, the overrides it passes (the
    file holds them as ``key=value`` or ``"key": value``) and, for the recipes, how the processes
    sit on nodes."""

    nproc: int
    overrides: tuple[str, ...]
    test: str
    nodes: int = 1


ACTOR_LAYOUTS = {
    "tp2": Layout(2, ("parallel.tensor_model_parallel_size=2",), "tests/actor/test_actor_resume.py"),
    "dp2": Layout(2, (), "tests/actor/test_actor_resume.py"),
    "pp2-gen-tp2": Layout(
        2,
        ("parallel.pipeline_model_parallel_size=2", "generation.tensor_parallel_size=2"),
        "tests/actor/test_actor_e2e.py",
    ),
    "tp2-dp2": Layout(
        4, ("parallel.tensor_model_parallel_size=2",), "tests/actor/test_actor_e2e.py", nodes=2
    ),
}
CRITIC_LAYOUTS = {
    "dp2": Layout(2, ("parallel.data_parallel_size=2",), "tests/critic/test_critic_dp.py"),
    "tp2": Layout(2, ("parallel.tensor_model_parallel_size=2",), "tests/critic/test_critic_tp.py"),
}
# The overrides that set a layout.
LAYOUT_KEYS = ("parallel.", "generation.tensor_parallel_size")
# Each data-parallel rank's share of the default minibatch (64) divides by this micro batch.
SMALL_MICRO_BATCH = "ppo.micro_batch_size=16"


def layout_of(overrides: tuple[str, ...] | list[str]) -> dict[str, int | None]:
    """{key: value} of the layout overrides, as Hydra reads the values."""
    out = {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith(LAYOUT_KEYS):
            out[key] = yaml.safe_load(value)
    return out


@functools.cache
def _default_layout(config: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose(config, []), resolve=False)


def layout_changes(config: str, overrides: list[str]) -> dict[str, int | None]:
    """The layout ``overrides`` set for ``config`` ('actor' or 'critic'), less those that restate a
    default: what a test must pass to run the same layout."""
    defaults = _default_layout(config)
    changed = {}
    for key, value in layout_of(overrides).items():
        section, name = key.split(".", 1)
        assert name in defaults[section], f"{key} is not a key of {config}.yaml"
        if defaults[section][name] != value:
            changed[key] = value
    return changed


def slurm_layout_env(actor: Layout, critic: Layout) -> dict[str, str]:
    """The SLURM script's knobs for these layouts (what a user sets along with the #SBATCH lines)."""
    a, c = layout_of(actor.overrides), layout_of(critic.overrides)
    tp, dp = c.get("parallel.tensor_model_parallel_size", 1), c.get("parallel.data_parallel_size", 1)
    gen_tp = a.get("generation.tensor_parallel_size")
    return {
        "SLURM_JOB_NODELIST_HET_GROUP_1": ",".join(f"gpu-a{i:02d}" for i in range(1, actor.nodes + 1)),
        "ACTOR_GPUS_PER_NODE": str(actor.nproc // actor.nodes),
        "ACTOR_TP": str(a.get("parallel.tensor_model_parallel_size", 1)),
        "ACTOR_PP": str(a.get("parallel.pipeline_model_parallel_size", 1)),
        "ACTOR_GEN_TP": "" if gen_tp is None else str(gen_tp),
        "CRITIC_TP": str(tp),
        "CRITIC_DP": str(dp),
        "CRITIC_GPUS": str(tp * dp),
    }


def k8s_layout_values(actor: Layout, critic: Layout) -> list[str]:
    """The values (as --set) for these layouts."""
    a, c = layout_of(actor.overrides), layout_of(critic.overrides)
    gen_tp = a.get("generation.tensor_parallel_size")
    return [
        f"actor_nodes={actor.nodes}",
        f"actor_gpus_per_node={actor.nproc // actor.nodes}",
        f"actor_tensor_parallel={a.get('parallel.tensor_model_parallel_size', 1)}",
        f"actor_pipeline_parallel={a.get('parallel.pipeline_model_parallel_size', 1)}",
        f"actor_generation_tensor_parallel={'null' if gen_tp is None else gen_tp}",
        f"critic_tensor_parallel={c.get('parallel.tensor_model_parallel_size', 1)}",
        f"critic_data_parallel={c.get('parallel.data_parallel_size', 1)}",
        f"actor_overrides=[{SMALL_MICRO_BATCH}]",
    ]


# Each actor layout is launched with one of the critic's: every layout of both roles is covered.
LAYOUT_PAIRS = [
    pytest.param(ACTOR_LAYOUTS[a], CRITIC_LAYOUTS[c], id=f"actor-{a}+critic-{c}")
    for a, c in zip(ACTOR_LAYOUTS, itertools.cycle(CRITIC_LAYOUTS))
]


def check_critic_launch(tr, cfg, critic: Layout) -> None:
    """The server's torchrun launch runs ``critic``'s layout: TP x DP processes, those overrides."""
    assert int(tr.nproc_per_node) == critic.nproc == cfg.parallel.world_size
    assert cfg.parallel.world_size_problem(critic.nproc) is None
    assert layout_changes("critic", tr.training_script_args) == layout_of(critic.overrides)


def check_actor_launch(tr, cfg, actor: Layout) -> None:
    """The actor's torchrun launch runs ``actor``'s layout with the test's overrides (``cfg``, the
    actor's checked config at that world size, shows the values arrive)."""
    nnodes = int(tr.nnodes.split(":")[-1])
    assert (nnodes, nnodes * int(tr.nproc_per_node)) == (actor.nodes, actor.nproc)
    assert layout_changes("actor", tr.training_script_args) == layout_of(actor.overrides)
    want = layout_of(actor.overrides)
    p = cfg.parallel
    assert p.tensor_model_parallel_size == want.get("parallel.tensor_model_parallel_size", 1)
    assert p.pipeline_model_parallel_size == want.get("parallel.pipeline_model_parallel_size", 1)
    assert cfg.generation.tensor_parallel_size == want.get("generation.tensor_parallel_size")


def test_the_layout_tables_are_what_the_tests_run():
    for layout in (*ACTOR_LAYOUTS.values(), *CRITIC_LAYOUTS.values()):
        text = (ROOT / layout.test).read_text()
        for key, value in layout_of(layout.overrides).items():
            assert f"{key}={value}" in text or f'"{key}": {value}' in text, f"{layout.test}: no {key}={value}"
    doc = (ROOT / "docs" / "launching.md").read_text()
    for test in {layout.test for layout in (*ACTOR_LAYOUTS.values(), *CRITIC_LAYOUTS.values())}:
        assert f"`{test}`" in doc, f"docs/launching.md does not name {test}"
    # The other engine's recipe and page.
    assert "`Dockerfile.trtllm`" in doc and (ROOT / "Dockerfile.trtllm").is_file()
    assert "(trtllm.md)" in doc and (ROOT / "docs" / "trtllm.md").is_file()


@pytest.mark.parametrize(("actor", "critic"), LAYOUT_PAIRS)
def test_sbatch_runs_the_tested_layouts_with_their_overrides(tmp_path, schemas, actor, critic):
    env = _slurm_env(tmp_path, **slurm_layout_env(actor, critic))
    run = subprocess.run(
        ["bash", str(SBATCH), SMALL_MICRO_BATCH], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    starts = {e["role"]: e for e in _log(tmp_path) if e["event"] == "start"}
    critic_run, actor_run = starts["critic"], starts["actor"]

    assert f"--gpus-per-node={critic.nproc}" in critic_run["args"]
    tr = torchrun(_after(critic_run["args"], "-m"))
    check_critic_launch(tr, critic_config(tr.training_script_args), critic)

    assert f"--nodes={actor.nodes}" in actor_run["args"]
    assert f"--gpus-per-node={actor.nproc // actor.nodes}" in actor_run["args"]
    tr = torchrun(_after(actor_run["args"], "-m"))
    check_actor_launch(tr, actor_config(tr.training_script_args, world_size=actor.nproc), actor)


@pytest.mark.parametrize(("actor", "critic"), LAYOUT_PAIRS)
def test_k8s_renders_the_tested_layouts_with_their_overrides(schemas, actor, critic):
    docs = rendered(*k8s_layout_values(actor, critic))
    dep, svc, pod, c, tr, cfg = critic_parts(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == critic.nproc
    check_critic_launch(tr, cfg, critic)

    if actor.nodes == 1:
        tr, cfg = check_actor_pod(docs, one(docs, "Job")["spec"]["template"]["spec"], "actor")
    else:
        job = one(docs, "PyTorchJob")
        pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        tr, cfg = check_actor_pod(docs, pod, "pytorch", operator_env=OPERATOR_ENV)
    check_actor_launch(tr, cfg, actor)


def test_layout_keys_the_recipes_pass_are_config_keys(schemas):
    """A misspelt layout key fails to compose, for both roles (the layout tests compose every
    override the recipes pass)."""
    with pytest.raises(ConfigCompositionException, match="data_paralel_size"):
        critic_config(["parallel.data_paralel_size=2"])
    with pytest.raises(ConfigCompositionException, match="pipline"):
        compose("actor", ["parallel.pipline_model_parallel_size=2"])


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"CRITIC_DP": "2"}, "CRITIC_TP=1 x CRITIC_DP=2 = 2 server processes, but CRITIC_GPUS=1"),
        ({"CRITIC_TP": "two"}, "CRITIC_TP='two': expected a positive integer"),
        ({"ACTOR_PP": "3"}, "ACTOR_TP=1 x ACTOR_PP=3 = 3"),
        ({"ACTOR_TP": "2"}, "ACTOR_TP=2 does not divide ACTOR_GPUS_PER_NODE=1"),
        ({"ACTOR_PP": "2", "ACTOR_GEN_TP": "3"}, "ACTOR_GEN_TP=3 does not divide ACTOR_TP x ACTOR_PP = 2"),
    ],
    ids=["critic-gpus", "not-a-number", "actor-world", "tp-across-nodes", "generation-tp"],
)
def test_sbatch_refuses_a_layout_that_does_not_fit_before_starting_anything(tmp_path, knobs, message):
    run = subprocess.run(
        ["bash", str(SBATCH)], env=_slurm_env(tmp_path, **knobs), capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and message in run.stderr, run.stdout + run.stderr
    assert _log(tmp_path) == [], "nothing may start"


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
    pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert args["TORCH_VERSION"] == pin, "the image's torch must be pyproject.toml's pin"
    runs = " ; ".join(a for i, a in steps if i == "RUN")
    assert (
        '"torch==${TORCH_VERSION}"' in runs and "pip install ." in runs and "pip install --no-deps ." in runs
    )
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
    assert exposed == {cfg.server.http_port, cfg.server.grpc_port, cfg.server.metrics_port}
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


# --- the readiness CLI ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_cli_times_out_naming_the_url(capsys, monkeypatch):
    url = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv(critic_client.ENV_URL, url)  # no --url: the actor's variable
    t0 = time.monotonic()
    assert wait_cli.main(["--timeout", "0.5"]) == 1
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert url in err and "not ready" in err
    assert wait_cli.main(["--url", "ftp://x:1", "--timeout", "1"]) == 2


def test_wait_cli_gives_up_when_the_server_process_exits(capsys):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    t0 = time.monotonic()
    code = wait_cli.main(
        ["--url", f"http://127.0.0.1:{_free_port()}", "--timeout", "60", "--pid", str(proc.pid)]
    )
    assert code == 1 and time.monotonic() - t0 < 10
    assert "has exited" in capsys.readouterr().err


def test_the_recipes_and_the_local_launcher_share_one_readiness_check():
    # The CLI the recipes run and the launcher of `make demo` (start_server) both wait through
    # readiness.wait_ready; the CLI also requires every model of the wire protocol.
    from aligner.wire import protocol

    assert wait_cli.wait_ready is readiness.wait_ready
    assert set(wait_cli.SERVED_MODELS) == set(protocol.MODELS)
    assert "wait_ready(" in Path(launch.__file__).read_text().split("class ServerProcess")[1]
    scripts = (ROOT / "pyproject.toml").read_text()
    assert 'aligner-wait-critic = "aligner.critic.wait:main"' in scripts


@pytest.mark.slow
@pytest.mark.server
def test_wait_cli_and_probe_paths_against_a_real_server(tmp_path):
    from aligner.critic.testing import tiny_overrides

    server = launch.start_server(tiny_overrides(tmp_path), log_path=tmp_path / "server.log")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "aligner.critic.wait", "--url", server.url, "--timeout", "30"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
        assert f"critic server at {server.url} is ready" in out.stdout
        c = container(one(rendered(), "Deployment")["spec"]["template"]["spec"], "critic")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            path = c[probe]["httpGet"]["path"]
            with urllib.request.urlopen(server.http_url + path, timeout=10) as r:
                assert r.status == 200, f"{probe} {path}"
    finally:
        server.kill()


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
