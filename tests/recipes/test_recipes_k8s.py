"""The Kubernetes recipe (examples/k8s) against the code.

The manifests are rendered exactly as a user renders them (examples/k8s/render.py), validated
against the Kubernetes API schema (kubernetes-validate ships it; no cluster), and their ports,
probe paths, environment names and command lines are checked against what the entry points read
and serve: every Hydra override is composed with the entry point's own structured schema and
checked as the entry point checks it, torchrun's arguments are parsed by torchrun's own parser.
Also the renderer's own rules, errors and command line. The layouts the tests run are in
test_recipes_layouts.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
    container,
    critic_parts,
    env_of,
    one,
    render,
    rendered,
    resolve_port,
    secret_env_of,
    secret_files_of,
)
from hydra.errors import ConfigCompositionException

from aligner.config_checks import ConfigError
from aligner.critic import probe as probe_cli
from aligner.wire import client as critic_client
from aligner.wire import readiness

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
    """rollout_workers=3: an Indexed Job of three one-GPU worker pods, each running the worker with
    the actor's overrides, the worker count, the store's address and its own rank (the completion
    index + 1, run here through the container's own shell command); the address names the one-node
    actor's headless Service (or the operator's Service of a PyTorchJob's Master), and the network
    policies let actor and workers reach each other."""
    docs = rendered(
        f"actor_nodes={nodes}",
        "rollout_workers=3",
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
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
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
    assert start["args"][:2] == ["-m", "aligner.rollout.worker"]
    wcfg = actor_config(start["args"][2:], world_size=1)
    assert wcfg.rollout.worker_rank == 3 and wcfg.rollout.address == address and wcfg.rollout.workers == 3
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
