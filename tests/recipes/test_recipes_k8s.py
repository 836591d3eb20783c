"""The Kubernetes recipe (examples/k8s) against the code.

The manifests are rendered exactly as a user renders them (examples/k8s/render.py), validated
against the Kubernetes API schema (kubernetes-validate ships it; no cluster), and their ports,
probe paths, environment names and command lines are checked against what the entry points read
and serve: every Hydra override is composed with the entry point's own structured schema and
checked as the entry point checks it, torchrun's arguments are parsed by torchrun's own parser.
With TLS on (tls_secret), each container mounts exactly the TLS files its settings name, and the
rendered probes, wait and actor settings are run against a real server on throwaway certificates.
Also the renderer's own rules, errors and command line. The layouts the tests run are in
test_recipes_layouts.py.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from _recipes import (
    K8S,
    OPERATOR_ENV,
    ROOT,
    _log,
    _slurm_env,
    actor_config,
    assert_dev_shm_in_memory,
    check_actor_pod,
    client_tls_of,
    compose,
    container,
    critic_parts,
    env_of,
    mounted_secret_copies,
    one,
    render,
    rendered,
    resolve_port,
    secret_env_of,
    secret_files_of,
    split_secret_files,
    tls_paths,
    torchrun,
    with_mounted_secrets,
)
from hydra.errors import ConfigCompositionException

from aligner.config_checks import ConfigError
from aligner.critic import probe as probe_cli
from aligner.critic import wait as wait_cli
from aligner.critic.launch import start_server
from aligner.critic.testing import tiny_overrides
from aligner.wire import client as critic_client
from aligner.wire import readiness
from aligner.wire.tls import ClientTLS

# The Kubernetes versions the manifests must be valid for: an older one still in service and the
# newest the package knows.
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())
# Triton's KServe v2 health endpoints (served on the HTTP port).
DNS_ONLY = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
UNPRIVILEGED_UID = 10001  # the Dockerfile's USER


def policy_named(docs: list[dict], name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == name]
    return found


def pods_of(docs: list[dict]) -> list[dict]:
    """Every pod template's spec: the critic's Deployment and the actor's Job or PyTorchJob."""
    pods = [one(docs, "Deployment")["spec"]["template"]["spec"]]
    for d in docs:
        if d["kind"] == "Job":
            pods.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "PyTorchJob":
            pods += [r["template"]["spec"] for r in d["spec"]["pytorchReplicaSpecs"].values()]
    return pods


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
    assert kinds == [
        "Secret",
        "PersistentVolumeClaim",
        "Service",
        "Deployment",
        "NetworkPolicy",
        actor_kind,
        "NetworkPolicy",
    ]
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


def test_critic_ports_probes_and_service_match_what_the_server_serves(schemas):
    dep, svc, pod, c, tr, cfg = critic_parts(rendered())
    assert cfg.server.host == "0.0.0.0", "server.host must let the Service reach the server"
    served = {"grpc": cfg.server.grpc_port, "metrics": cfg.server.metrics_port}
    assert all(served.values()), f"fixed ports are needed behind a Service, got {served}"
    assert cfg.server.http_port is None, "HTTP stays off (README.md, 'What the server trusts')"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == served

    # The Service: the named gRPC port (and metrics) that lead to the server's; there is no HTTP.
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(ports) == {"grpc", "metrics"}
    for name, p in ports.items():
        assert resolve_port(c, p["targetPort"]) == served[name]
        assert p["port"] == served[name], "clients dial the server's own port numbers"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()

    # Probes: python -m aligner.critic.probe, a server_info round trip through the Python service
    # (tests/critic/test_critic_probe.py: it fails where Triton's own /v2/health/live still
    # answers), on the pod's own gRPC port, within the probe's timeout; readiness and start-up also
    # need every model ready (the readiness the launcher and the actor's client wait for).
    for name, ready in (("readinessProbe", True), ("livenessProbe", False), ("startupProbe", True)):
        command = c[name]["exec"]["command"]
        assert command[:3] == ["python", "-m", "aligner.critic.probe"], command
        args = probe_cli._parser().parse_args(command[3:])
        scheme, hostport = readiness.parse_url(args.url)
        assert (scheme, hostport) == ("grpc", f"127.0.0.1:{cfg.server.grpc_port}")
        assert args.ready is ready
        assert 0 < args.timeout < c[name]["timeoutSeconds"] <= c[name]["periodSeconds"], name
    assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] >= 60
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
    docs = rendered(*nodes, "actor_overrides=[+recipe=digits, ppo.micro_batch_size=16]")
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
    """Writes need the run token: one Secret, mounted as a file in the critic and in every actor
    pod (Job and PyTorchJob) at the path each role's config names, never in an environment or on
    a command line; only the actor's pods reach the critic's gRPC port, and the critic reaches
    only DNS."""
    for nodes in (1, 3):
        docs = rendered(f"actor_nodes={nodes}")
        secret = one(docs, "Secret")
        token = secret["stringData"]["token"]
        assert len(token) >= render.MIN_TOKEN_CHARS and secret["immutable"] is True
        ref = (secret["metadata"]["name"], "token")
        dep, svc, critic_pod, c, tr, cfg = critic_parts(docs)
        assert secret_env_of(c) == {}
        ((path, got),) = secret_files_of(docs, critic_pod, c).items()
        assert got == ref and f"server.run_token_file={path}" in tr.training_script_args
        # The server's config check read the file as mounted (critic_parts): the Secret's token.
        assert cfg.server.run_token_file is not None
        assert token not in " ".join(c["args"])
        (vol,) = [v for v in critic_pod["volumes"] if "secret" in v]
        assert vol["secret"]["defaultMode"] == 0o440 and critic_pod["securityContext"]["fsGroup"]
        actor = one(docs, "Job" if nodes == 1 else "PyTorchJob")
        pods = (
            [actor["spec"]["template"]]
            if nodes == 1
            else [r["template"] for r in actor["spec"]["pytorchReplicaSpecs"].values()]
        )
        for pod in pods:
            (main,) = pod["spec"]["containers"]
            assert secret_env_of(main) == {} and secret_files_of(docs, pod["spec"], main) == {path: ref}
            assert f"critic.run_token_file={path}" in main["args"]

        policy = policy_named(docs, f"{secret['metadata']['labels']['app.kubernetes.io/instance']}-critic")
        critic_labels = dep["spec"]["template"]["metadata"]["labels"]
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"].items() <= critic_labels.items()
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        assert spec["egress"] == [DNS_ONLY], "the server calls nothing but DNS"
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}, "actor pods by label, nothing else"
        admitted = peer["podSelector"]["matchLabels"]
        for pod in pods:
            assert admitted.items() <= pod["metadata"]["labels"].items()
        assert not admitted.items() <= critic_labels.items()
        ports = {resolve_port(c, p["port"]) for p in rule["ports"]}
        svc_ports = {p["name"]: resolve_port(c, p["targetPort"]) for p in svc["spec"]["ports"]}
        assert ports == {svc_ports["grpc"]} == {cfg.server.grpc_port}
    # A fresh token per render, unless the values give one.
    assert one(rendered(), "Secret")["stringData"] != one(rendered(), "Secret")["stringData"]
    given = "a-run-token-of-my-own-0123"
    assert one(rendered(f"run_token={given}"), "Secret")["stringData"]["token"] == given


@pytest.mark.parametrize("nodes", [1, 3])
def test_every_pod_runs_unprivileged_read_only_and_within_a_memory_limit(nodes):
    docs = rendered(f"actor_nodes={nodes}")
    steps = (ROOT / "Dockerfile").read_text().split("\n")
    assert f"USER {UNPRIVILEGED_UID}" in steps, "the image's user is the one the pods run as"
    for pod in pods_of(docs):
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == UNPRIVILEGED_UID
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        vols = {v["name"]: v for v in pod["volumes"]}
        for c in pod.get("initContainers", []) + pod["containers"]:
            csc = c["securityContext"]
            assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
            assert csc["capabilities"] == {"drop": ["ALL"]}
            # What the processes write goes to volumes: /tmp (XDG_CACHE_HOME, HOME, torchrun).
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "emptyDir" in vols[mounts["/tmp"]], c["name"]
        for c in pod["containers"]:
            res = c["resources"]
            assert res["limits"]["memory"] == res["requests"]["memory"], c["name"]


@pytest.mark.parametrize("nodes", [1, 3])
def test_actor_network_policy_lets_the_actor_reach_its_peers_the_critic_and_dns_only(nodes):
    docs = rendered(f"actor_nodes={nodes}")
    run = one(docs, "Secret")["metadata"]["labels"]["app.kubernetes.io/instance"]
    spec = policy_named(docs, f"{run}-actor")["spec"]
    actor_pods = pods_of(docs)[1:]
    critic_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for d in docs:
        if d["kind"] in ("Job", "PyTorchJob"):
            templates = (
                [d["spec"]["template"]]
                if d["kind"] == "Job"
                else [r["template"] for r in d["spec"]["pytorchReplicaSpecs"].values()]
            )
    assert len(templates) == len(actor_pods)
    for tpl in templates:
        assert spec["podSelector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = spec["ingress"]
    (peers, workers, critic, dns) = spec["egress"]
    assert ingress["from"] == peers["to"] + workers["to"] and "ports" not in ingress and "ports" not in peers
    assert workers["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "rollout"
    assert critic["to"][0]["podSelector"]["matchLabels"].items() <= critic_labels.items()
    cfg = critic_parts(docs)[-1]
    assert [p["port"] for p in critic["ports"]] == [cfg.server.grpc_port]
    assert dns == DNS_ONLY
    # actor_egress adds rules of the user's own (W&B, a model hub).
    https = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443}]}
    more = rendered(
        f"actor_nodes={nodes}", "actor_egress=[{to: [{ipBlock: {cidr: 0.0.0.0/0}}], ports: [{port: 443}]}]"
    )
    extra = policy_named(more, f"{run}-actor")
    validate(extra)
    assert extra["spec"]["egress"] == [peers, workers, critic, dns, https]


@pytest.mark.parametrize("nodes", [1, 2])
def test_rollout_workers_join_the_actors_store_with_its_overrides(tmp_path, schemas, nodes):
    """rollout_workers=3 of rollout_tensor_parallel=2: an Indexed Job of three two-GPU worker pods,
    each a torchrun of two worker processes with the actor's overrides, the worker count and size,
    the store's address and its own rank (the completion index + 1, run here through the
    container's own shell command); the address names the one-node
    actor's headless Service (or the operator's Service of a PyTorchJob's Master), and the network
    policies let actor and workers reach each other."""
    docs = rendered(
        f"actor_nodes={nodes}",
        "rollout_workers=3",
        "rollout_tensor_parallel=2",
        "actor_overrides=[+recipe=digits, rollout.max_staleness=1, ppo.tis_cap=2.0, ppo.micro_batch_size=32]",
    )
    for d in docs:
        validate(d)
    run = one(docs, "Secret")["metadata"]["labels"]["app.kubernetes.io/instance"]
    named = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Job", "PyTorchJob")}
    job = named[f"{run}-rollout"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
    pod = spec["template"]["spec"]
    c = container(pod, "rollout")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert not env_of(c) and "run-token" not in {v["name"] for v in pod["volumes"]}  # no credentials
    host = f"{run}-rollout-store" if nodes == 1 else OPERATOR_ENV["MASTER_ADDR"].replace("run-", f"{run}-")
    address = f"{host}:{render.ROLLOUT_PORT}"
    if nodes == 1:
        (store,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host]
        actor_labels = named[f"{run}-actor"]["spec"]["template"]["metadata"]["labels"]
        assert store["spec"]["clusterIP"] == "None"  # resolves to the actor's pod: pod-to-pod groups
        assert store["spec"]["selector"].items() <= actor_labels.items()
        assert [p["port"] for p in store["spec"]["ports"]] == [render.ROLLOUT_PORT]
        actor_pod = named[f"{run}-actor"]["spec"]["template"]["spec"]
    else:
        assert not [d for d in docs if d["metadata"]["name"] == f"{run}-rollout-store"]
        actor_pod = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    name, operator = ("actor", None) if nodes == 1 else ("pytorch", OPERATOR_ENV)
    _, acfg = check_actor_pod(docs, actor_pod, name, operator_env=operator)
    assert (acfg.rollout.workers, acfg.rollout.address, acfg.rollout.max_staleness) == (3, address, 1)

    # The container's command, as its shell runs it in the pod of index 2.
    env = _slurm_env(tmp_path)
    done = subprocess.run(c["args"], env={**env, "JOB_COMPLETION_INDEX": "2"}, timeout=60)
    assert done.returncode == 0
    (start,) = [e for e in _log(tmp_path) if e["event"] == "start"]
    assert start["args"][:2] == ["-m", "torch.distributed.run"]
    wtr = torchrun(start["args"][2:])
    assert (wtr.standalone, wtr.nproc_per_node, wtr.module) == (True, "2", True)
    assert wtr.training_script == "aligner.rollout.worker"
    wcfg = actor_config(wtr.training_script_args, world_size=1)
    assert wcfg.rollout.worker_rank == 3 and wcfg.rollout.address == address and wcfg.rollout.workers == 3
    assert wcfg.rollout.tensor_parallel_size == 2 == acfg.rollout.tensor_parallel_size
    assert wcfg.model == acfg.model and wcfg.rollout.max_staleness == 1

    # Actor and workers reach each other, and the workers nothing but DNS besides.
    policy = policy_named(docs, f"{run}-rollout")["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    (ingress,) = policy["ingress"]
    (to_actor, dns) = policy["egress"]
    assert ingress["from"] == to_actor["to"] and dns == DNS_ONLY
    assert to_actor["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "actor"
    actor_policy = policy_named(docs, f"{run}-actor")["spec"]
    assert any(
        sel["podSelector"]["matchLabels"].items() <= labels.items()
        for sel in actor_policy["ingress"][0]["from"]
    )
    # Generation belongs to the workers: the actor's own generation TP is refused with them.
    with pytest.raises(render.RenderError, match="actor_generation_tensor_parallel=1 with rollout_workers=3"):
        rendered("rollout_workers=3", "actor_generation_tensor_parallel=1")


def test_rollout_workers_that_score_reach_the_critic_as_the_actor_does(tmp_path, schemas):
    """rollout_score_on_workers=true (with mutual TLS): the actor and every worker get
    rollout.score_on_workers; each worker dials the actor's critic URL with the same CA and client
    certificate (never the server's key, nor the run token), and the network policies let the
    workers reach the critic's gRPC port and nothing else of it."""
    docs = rendered(
        "rollout_workers=2",
        "rollout_score_on_workers=true",
        f"tls_secret={TLS_SECRET}",
        "tls_client_auth=true",
        "actor_overrides=[+recipe=digits, ppo.advantage=grpo, ppo.samples_per_prompt=4, ppo.micro_batch_size=32]",
    )
    for d in docs:
        validate(d)
    run = one(docs, "Secret")["metadata"]["labels"]["app.kubernetes.io/instance"]
    named = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Job", "PyTorchJob")}
    _, acfg = check_actor_pod(docs, named[f"{run}-actor"]["spec"]["template"]["spec"], "actor")
    pod = named[f"{run}-rollout"]["spec"]["template"]["spec"]
    c = container(pod, "rollout")
    actor_c = container(named[f"{run}-actor"]["spec"]["template"]["spec"], "actor")
    assert env_of(c) == {"ALIGNER_CRITIC_URL": env_of(actor_c)["ALIGNER_CRITIC_URL"]}
    assert env_of(c)["ALIGNER_CRITIC_URL"].startswith("grpcs://")
    files = secret_files_of(docs, pod, c)
    assert {ref for ref in files.values()} == {
        (TLS_SECRET, k) for k in ("ca.crt", "client.crt", "client.key")
    }
    wtr = torchrun(_worker_args(c))
    assert tls_paths(actor_config_unchecked(wtr.training_script_args).critic.tls) == set(files)
    with tempfile.TemporaryDirectory() as tmp:  # the worker's checks, its mounted files in place
        wcfg = actor_config(
            with_mounted_secrets(wtr.training_script_args, docs, pod, c, Path(tmp)), world_size=1
        )
        wcfg.critic.tls.check(env_of(c)["ALIGNER_CRITIC_URL"], "grpcs")
    assert wcfg.rollout.score_on_workers and acfg.rollout.score_on_workers

    rollout_policy = policy_named(docs, f"{run}-rollout")["spec"]
    critic_rule = [
        e for e in rollout_policy["egress"] if e.get("ports") == [{"port": "grpc", "protocol": "TCP"}]
    ]
    (rule,) = critic_rule
    assert rule["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "critic"
    critic_from = policy_named(docs, f"{run}-critic")["spec"]["ingress"][0]["from"]
    assert {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in critic_from} == {
        "actor",
        "rollout",
    }
    with pytest.raises(render.RenderError, match="rollout_score_on_workers=true with rollout_workers=0"):
        rendered("rollout_score_on_workers=true")


def actor_config_unchecked(overrides: list[str]):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose("actor", overrides))


def _worker_args(c: dict) -> list[str]:
    """What torchrun is given in a rollout worker pod: the shell's command line with the pod's
    arguments in place of "$@" (and rank 1)."""
    script, args = c["args"][2], c["args"][4:]
    head = script.split('"$@"')[0].split()
    return [*head[head.index("torch.distributed.run") + 1 :], *args, "rollout.worker_rank=1"]


def test_user_overrides_reach_each_role_and_must_be_real_keys(schemas):
    docs = rendered(
        "critic_overrides=[+server_recipe=digits, optim.lr=3e-4, model.num_layers=4]",
        "actor_overrides=[+recipe=digits, ppo.num_steps=7]",
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
    assert names == {critic_client.ENV_URL}
    for name in names:
        assert f'"{name}"' in source, f"no code reads ${name}"


# --- TLS on the critic's gRPC endpoint ------------------------------------------------------------

TLS_SECRET = "ppo-sort-critic-tls"  # a Secret of the user's own (cert-manager's keys, + client's)
SERVER_KEYS = {"tls.crt", "tls.key", "ca.crt"}
CLIENT_KEYS = {"client.crt", "client.key"}


def overrides_under(args: list[str], section: str) -> dict[str, str]:
    """The ``section.key=value`` overrides among ``args``: key -> value (the paths as in the pod;
    the checked configs hold the test's copies of the mounted files)."""
    return {
        k.removeprefix(f"{section}."): v
        for k, _, v in (a.partition("=") for a in args)
        if k.startswith(f"{section}.")
    }


def actor_pods(docs: list[dict]) -> list[tuple[dict, str, dict | None]]:
    """(pod spec, main container's name, operator environment) of every actor pod template."""
    for d in docs:
        if d["kind"] == "Job" and d["metadata"]["labels"]["app.kubernetes.io/component"] == "actor":
            return [(d["spec"]["template"]["spec"], "actor", None)]
        if d["kind"] == "PyTorchJob":
            specs = d["spec"]["pytorchReplicaSpecs"].values()
            return [(r["template"]["spec"], "pytorch", OPERATOR_ENV) for r in specs]
    raise AssertionError("no actor")


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("mutual", [False, True])
def test_tls_secret_turns_tls_on_for_the_critic_its_probes_the_actor_and_its_wait(
    tmp_path, schemas, nodes, mutual
):
    """tls_secret (and tls_client_auth): the critic mounts the Secret's files read-only and names
    them in server.tls, its probes dial grpcs://localhost with the CA (and the client certificate
    of mutual TLS), and every actor pod dials grpcs://<run>-critic with critic.tls, its wait with
    the same --tls-* flags, each mounting exactly the files it names (never the server's key);
    both roles' configs pass their own checks (critic_parts, check_actor_pod)."""
    sets = [
        f"tls_secret={TLS_SECRET}",
        f"tls_client_auth={str(mutual).lower()}",
        f"actor_nodes={nodes}",
        "actor_overrides=[+recipe=digits, ppo.micro_batch_size=32]",  # 32 per rank with 2 nodes
    ]
    docs = rendered(*sets)
    for d in docs:
        validate(d)
    assert [d for d in docs if d["kind"] == "Secret"] == [one(docs, "Secret")], (
        "the user's Secret is not rendered"
    )

    # The critic: server.tls names exactly the mounted files, besides those the probes name.
    dep, svc, pod, c, tr, cfg = critic_parts(docs)
    tls = cfg.server.tls
    assert tls.on and tls.mutual is mutual and tls.scheme == "grpcs"
    token, tls_files = split_secret_files(docs, pod, c)
    assert len(token) == 1 and {ref[0] for ref in tls_files.values()} == {TLS_SECRET}
    assert {ref[1] for ref in tls_files.values()} == SERVER_KEYS | (CLIENT_KEYS if mutual else set())
    (vol,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == TLS_SECRET]
    assert vol["secret"]["defaultMode"] == 0o440
    by_key = {ref[1]: path for path, ref in tls_files.items()}
    server_tls = overrides_under(tr.training_script_args, "server.tls")
    assert server_tls == {
        "cert_file": by_key["tls.crt"],
        "key_file": by_key["tls.key"],
        **({"client_ca_file": by_key["ca.crt"]} if mutual else {}),
    }
    probed = set()
    with tempfile.TemporaryDirectory() as tmp:
        local = mounted_secret_copies(docs, pod, c, Path(tmp))
        for name in ("readinessProbe", "livenessProbe", "startupProbe"):
            args = probe_cli._parser().parse_args(c[name]["exec"]["command"][3:])
            scheme, hostport = readiness.parse_url(args.url)
            assert (scheme, hostport) == ("grpcs", f"localhost:{cfg.server.grpc_port}"), (
                "a name the certificate holds"
            )
            named = client_tls_of(args)
            assert named.ca_file == by_key["ca.crt"] and bool(named.cert_file) is mutual
            # The probe's own check of its URL and flags, on the files as mounted.
            as_mounted = (local[p] if p else None for p in (named.ca_file, named.cert_file, named.key_file))
            ClientTLS(*as_mounted).check(args.url, scheme, prefix="--tls")
            probed |= tls_paths(named)
    assert set(tls_files) == set(server_tls.values()) | probed, (
        "every mounted TLS file is used, and only those"
    )

    # The actor (Job or every PyTorchJob replica) and its wait: check_actor_pod asserts the grpcs
    # URL and that each container mounts exactly the TLS files it names; here, which those are.
    for actor_pod, name, operator in actor_pods(docs):
        _, acfg = check_actor_pod(docs, actor_pod, name, operator_env=operator)
        assert acfg.critic.tls.ca_file and bool(acfg.critic.tls.cert_file) is mutual
        actor_tls = overrides_under(container(actor_pod, name)["args"], "critic.tls")
        assert actor_tls == {
            "ca_file": by_key["ca.crt"],
            **({"cert_file": by_key["client.crt"], "key_file": by_key["client.key"]} if mutual else {}),
        }
        for cont in (container(actor_pod, "wait-for-critic", init=True), container(actor_pod, name)):
            assert env_of(cont)[critic_client.ENV_URL] == f"grpcs://{svc['metadata']['name']}:8001"
            keys = {ref[1] for ref in split_secret_files(docs, actor_pod, cont)[1].values()}
            assert keys == {"ca.crt"} | (CLIENT_KEYS if mutual else set()), "never the server's key"
        wait = container(actor_pod, "wait-for-critic", init=True)
        wait_tls = client_tls_of(wait_cli._parser().parse_args(wait["args"][3:]))
        assert tls_paths(wait_tls) == set(actor_tls.values()), (
            "the wait trusts and presents what the actor does"
        )

    # Rollout workers never contact the critic: no TLS files, no critic.tls.
    workers = rendered(*sets, "rollout_workers=2")
    rollout = one(workers, "Job", "rollout")["spec"]["template"]["spec"]
    assert [v["name"] for v in rollout["volumes"] if "secret" in v] == []
    assert not [a for a in container(rollout, "rollout")["args"] if "tls" in a]


def make_k8s_pki(d: Path, run: str) -> Path:
    """The certificates of docs/launching.md's Kubernetes recipe, as files named by their Secret
    keys: a CA (ca.crt), the server's (tls.crt, tls.key) naming <run>-critic and localhost, and the
    actor's client certificate (client.crt, client.key)."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl(
        "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=critic-ca"
    )
    # IP:127.0.0.1 beyond the recipe's names: start_server checks the server's readiness there.
    san = f"DNS:{run}-critic,DNS:{run}-critic.default.svc,DNS:localhost,IP:127.0.0.1"
    (d / "tls.ext").write_text(f"subjectAltName={san}\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, cn in (("tls", f"{run}-critic"), ("client", f"{run}-actor")):
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        )  # fmt: skip
    return d


@pytest.mark.server
def test_rendered_mutual_tls_works_against_a_real_server(tmp_path, schemas):
    """The rendered manifests with mutual TLS, run against a real (tiny) server started with the
    critic's rendered server.tls overrides, on the certificates docs/launching.md makes: the
    rendered probe and wait commands succeed, the actor's critic.tls reads server_info, and the
    server's certificate passes a check for the Service's name the actor dials."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command-line tool is not installed (it makes the test certificates)")
    docs = rendered(f"tls_secret={TLS_SECRET}", "tls_client_auth=true")
    run = one(docs, "Secret")["metadata"]["labels"]["app.kubernetes.io/instance"]
    pki = make_k8s_pki(tmp_path, run)
    dep, svc, pod, c, tr, _ = critic_parts(docs)
    local = {path: str(pki / key) for path, (_, key) in split_secret_files(docs, pod, c)[1].items()}

    def in_test(args: list[str]) -> list[str]:  # the pod's paths -> the test's files
        return [local.get(a, a) for a in args]

    token = tmp_path / "token"
    token.write_text("a-run-token-of-the-test-0123")
    server_tls = {
        f"server.tls.{k}": local[v] for k, v in overrides_under(tr.training_script_args, "server.tls").items()
    }
    assert set(server_tls) == {"server.tls.cert_file", "server.tls.key_file", "server.tls.client_ca_file"}
    client = ClientTLS(str(pki / "ca.crt"), str(pki / "client.crt"), str(pki / "client.key"))
    overrides = tiny_overrides(tmp_path / "server", **server_tls, **{"server.run_token_file": token})
    server = start_server(overrides, log_path=tmp_path / "server.stderr", tls=client, ready_timeout_s=90)
    try:
        port = readiness.parse_url(server.url)[1].rsplit(":", 1)[1]
        for name in ("startupProbe", "livenessProbe", "readinessProbe"):
            args = in_test(c[name]["exec"]["command"][3:])
            assert probe_cli.main([a.replace("localhost:8001", f"localhost:{port}") for a in args]) == 0, name
        for actor_pod, name, _ in actor_pods(docs):
            wait = container(actor_pod, "wait-for-critic", init=True)
            url = env_of(wait)[critic_client.ENV_URL].replace(
                f"{svc['metadata']['name']}:8001", f"localhost:{port}"
            )
            assert wait_cli.main([*in_test(wait["args"][3:]), "--url", url, "--quiet"]) == 0
            tls = ClientTLS(
                **{
                    k: local[v]
                    for k, v in overrides_under(container(actor_pod, name)["args"], "critic.tls").items()
                }
            )
            with critic_client.RemoteCriticClient(url, tls=tls, timeout_s=60) as remote:
                assert remote.server_info().protocol_version > 0
        # The Service's name, which the actor dials in the cluster, is one the certificate holds.
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(pki / "client.crt", pki / "client.key")
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as sock:
            with ctx.wrap_socket(sock, server_hostname=svc["metadata"]["name"]) as tls_sock:
                assert tls_sock.version() is not None
    finally:
        server.stop()


def test_tls_off_leaves_no_trace():
    """Without tls_secret the manifests are those of a recipe without TLS: plain grpc:// URLs, the
    probes on 127.0.0.1, no TLS volume, override or flag, and no template markers."""
    for sets in ((), ("rollout_workers=2",), ("actor_nodes=2", "rollout_workers=2")):
        text = render.render(render.load_values([], list(sets)))
        assert "tls" not in text.lower() and "#if" not in text and "#end" not in text
        assert (
            'command: [python, -m, aligner.critic.probe, --ready, --url, "grpc://127.0.0.1:8001", --timeout, "8"]'
            in text
        )
        assert 'args: [python, -m, aligner.critic.wait, --timeout, "1800"]' in text
        assert 'value: "grpc://ppo-sort-critic:8001"' in text


def test_tls_values_are_checked():
    for sets, pattern in (
        (["tls_secret=Not_A_Name"], r"tls_secret='Not_A_Name': expected the name of a Secret .* DNS-1123"),
        ([f"tls_secret={'a' * 254}"], r"tls_secret='a+': expected .*at most 253"),
        (["tls_secret=-leading-dash"], r"tls_secret='-leading-dash'"),
        (["tls_client_auth=true"], r"tls_client_auth=true with tls_secret=null: .* set tls_secret"),
        (["tls_client_auth=maybe"], r"tls_client_auth='maybe': expected true or false"),
        (
            [f"tls_secret={TLS_SECRET}", "critic_overrides=[+server_recipe=digits, server.tls.cert_file=/x]"],
            r"critic_overrides: .*server.tls.cert_file=/x.* set server.tls by hand; set tls_secret",
        ),
        (
            ["actor_overrides=[+recipe=digits, critic.tls.ca_file=/x]"],
            r"actor_overrides: .* set critic.tls by hand",
        ),
    ):
        with pytest.raises(render.RenderError, match=pattern):
            render.load_values([], sets)
    # A dotted name is a valid Secret name; other keys of the sections are the user's to set.
    render.load_values(
        [], ["tls_secret=critic.tls-v2", "critic_overrides=[+server_recipe=digits, server.tlsx=1]"]
    )


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
    # A flow list's quoted placeholder takes a list's items; #if blocks (nested) go with their value.
    flow = 'f: [a, "${b}", z]\ng: [a, "${c}", z]\nh: [a, "${d}"]\n'
    assert yaml.safe_load(render.render_text(flow, values)) == {
        "f": ["a", "x=1", "y=2", "z"],
        "g": ["a", "z"],
        "h": ["a", "3"],
    }
    blocks = "l:\n  - 1\n  #if ${b}\n  - 2\n  #if ${a}\n  - 3\n  #end\n  #end\n  #if ${c}\n  - 4\n  #end\n"
    assert render.render_text(blocks, values) == "l:\n  - 1\n  - 2\n"
    for text, pattern in (("#if ${b}\nx: 1\n", "#if without its #end"), ("x: 1\n#end\n", "line 2: #end")):
        with pytest.raises(render.RenderError, match=pattern):
            render.render_text(text, values)
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
