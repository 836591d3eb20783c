"""The parallel layouts the end-to-end tests run (the tables here, kept in step with the tests
and with docs/launching.md), reached by both recipes with exactly those tests' overrides: the SLURM
script (under stand-in commands) and the Kubernetes manifests, each launch's overrides checked by
the entry point's own config checks; and layouts that do not fit refused before anything starts.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
from typing import NamedTuple

import pytest
import yaml
from _recipes import (
    OPERATOR_ENV,
    ROOT,
    SBATCH,
    _after,
    _log,
    _slurm_env,
    actor_config,
    check_actor_pod,
    compose,
    critic_config,
    critic_parts,
    one,
    rendered,
    torchrun,
)
from hydra.errors import ConfigCompositionException

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
        f"actor_overrides=[+recipe=digits, {SMALL_MICRO_BATCH}]",
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
        ["bash", str(SBATCH), "+recipe=digits", SMALL_MICRO_BATCH],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
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
        (
            {"ROLLOUT_WORKERS_PER_NODE": "4"},
            "ROLLOUT_WORKERS_PER_NODE=4 x ROLLOUT_CPUS=4 leave the actor no CPUs",
        ),
        (
            {"ROLLOUT_WORKERS_PER_NODE": "1", "ROLLOUT_TP": "2", "SLURM_GPUS_PER_NODE_HET_GROUP_1": "2"},
            "component 1 has 2 GPU(s) per node, but ACTOR_GPUS_PER_NODE=1 + ROLLOUT_WORKERS_PER_NODE=1 x "
            "ROLLOUT_TP=2 need 3",
        ),
        ({"ROLLOUT_TP": "0"}, "ROLLOUT_TP='0': expected a positive integer"),
        ({"ROLLOUT_WORKERS_PER_NODE": "-1"}, "ROLLOUT_WORKERS_PER_NODE='-1': expected an integer >= 0"),
        ({"CRITIC_RESTARTS": "many"}, "CRITIC_RESTARTS='many': expected an integer >= 0"),
    ],
    ids=[
        "critic-gpus",
        "not-a-number",
        "actor-world",
        "tp-across-nodes",
        "generation-tp",
        "rollout-cpus",
        "rollout-gpus",
        "rollout-tp",
        "rollout-workers",
        "critic-restarts",
    ],
)
def test_sbatch_refuses_a_layout_that_does_not_fit_before_starting_anything(tmp_path, knobs, message):
    run = subprocess.run(
        ["bash", str(SBATCH)], env=_slurm_env(tmp_path, **knobs), capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and message in run.stderr, run.stdout + run.stderr
    assert _log(tmp_path) == [], "nothing may start"
