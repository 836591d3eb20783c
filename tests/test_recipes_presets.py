"""The presets (Hydra config groups inside the package): ``aligner-train +recipe=<name>`` and
``aligner-serve-critic +server_recipe=<name>``, in aligner/configs/recipe/ and
aligner/configs/server_recipe/.

Every preset composes with the real config and passes what its entry point checks before it builds
a model: the actor's step 1 (:func:`aligner.actor.run.read_inputs`: the architecture from
``init_from``, the tokenizer, the config checks, the training and validation prompts), the
server's :func:`aligner.critic.config.build_config`. They run in a folder of stand-ins for what the
presets name: ``models/<name>`` with the real model's ``config.json`` and a tiny tokenizer,
``data/`` with a few rows of each data set's layout. Each actor preset has its server's pair, and
the two agree. A command-line override after a preset wins. Every preset the docs name exists,
and every command line in README.md's code blocks uses keys its entry point has.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _word_tokenizer import save_word_tokenizer
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "aligner" / "configs"
EXPECTED = {"demo", "gsm8k_ppo_qwen2.5_0.5b", "grpo_lora_qwen2.5_1.5b", "sentiment_gpt2"}


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


RECIPES = presets("recipe")
SERVER_RECIPES = presets("server_recipe")


@pytest.fixture(scope="module", autouse=True)
def schemas():
    """Each entry point's structured schema, registered as running it does."""
    import aligner.actor.run  # noqa: F401
    import aligner.critic.server  # noqa: F401


def compose(config: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return hydra_compose(config, overrides=list(overrides))


# --- the stand-in workspace --------------------------------------------------------------------------

# The config.json of each model folder a preset names (the real models' architectures, so that the
# presets' model.* keys are checked against them as the actor checks them).
_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 21,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "attention_dropout": 0.0,
}
MODELS = {
    "qwen2.5-0.5b-instruct": dict(
        _QWEN2,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "qwen2.5-1.5b-instruct": dict(
        _QWEN2,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_window_layers=28,
    ),
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 12,
        "n_positions": 1024,
        "layer_norm_epsilon": 1e-05,
        "vocab_size": 50257,
    },
    # The sentiment classifier: only its folder is named (examples/sentiment/reward.py loads it).
    "distilbert-imdb": {"architectures": ["DistilBertForSequenceClassification"], "model_type": "distilbert"},
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "how many eggs does janet sell a day she makes dollars the movie was think step by".split()
GSM8K_ROWS = [
    {
        "question": "Janet sells 9 eggs a day at $2 each. How many dollars does she make?",
        "answer": "9 * 2 = 18\n#### 18",
    },
    {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A day has 24 hours. How many hours are in 2 days?", "answer": "2 * 24 = 48\n#### 48"},
]


def _tokenizer(folder: Path, template: str | None) -> None:
    """A word-level HF tokenizer (one token per word, role markers as special tokens)."""
    save_word_tokenizer(folder, WORDS, template)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The folder the roles run in: models/, data/ and examples/ (the repository's, for the reward
    functions the sentiment preset imports from examples/sentiment)."""
    from datasets import Dataset, DatasetDict

    root = tmp_path_factory.mktemp("workspace")
    for name, config in MODELS.items():
        folder = root / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
        if config["architectures"][0].endswith("ForCausalLM") or name == "gpt2":
            _tokenizer(folder, CHAT_TEMPLATE if config["model_type"] == "qwen2" else None)
    # openai/gsm8k (main) as DatasetDict.save_to_disk writes it: splits train and test.
    columns = {k: [r[k] for r in GSM8K_ROWS] for k in GSM8K_ROWS[0]}
    DatasetDict({"train": Dataset.from_dict(columns), "test": Dataset.from_dict(columns)}).save_to_disk(
        str(root / "data" / "gsm8k")
    )
    # examples/sentiment/prepare_imdb.py's prompt file.
    (root / "data" / "imdb_prompts.jsonl").write_text(
        "".join(
            json.dumps({"prompt": p}) + "\n" for p in ["The movie was", "I think the", "Overall, the plot"]
        )
    )
    (root / "examples").symlink_to(ROOT / "examples")
    return root


def _models_named(cfg) -> set[str]:
    """The model folders (models/<name>) a composed config names."""
    text = json.dumps(OmegaConf.to_container(cfg, resolve=True))
    return set(re.findall(r'"models/([^"/]+)"', text))


# --- the presets themselves --------------------------------------------------------------------------


def test_the_presets_come_in_pairs():
    assert EXPECTED <= set(RECIPES), f"missing actor presets: {EXPECTED - set(RECIPES)}"
    assert RECIPES == SERVER_RECIPES, (
        "each preset has an actor side (recipe/) and a server side (server_recipe/)"
    )


def test_the_wheel_carries_the_presets():
    """pyproject.toml's package data for aligner.configs matches every preset file (a wheel built
    with the plain "*.yaml" leaves the groups' folders out)."""
    from fnmatch import fnmatch

    line = re.search(r'^"aligner\.configs" = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    patterns = re.findall(r'"([^"]+)"', line.group(1))
    for path in sorted(CONFIGS.rglob("*.yaml")):
        rel = path.relative_to(CONFIGS).as_posix()
        assert any(fnmatch(rel, p) and rel.count("/") == p.count("/") for p in patterns), rel


@pytest.mark.parametrize(
    "group, name", [("recipe", n) for n in RECIPES] + [("server_recipe", n) for n in SERVER_RECIPES]
)
def test_each_file_sets_top_level_keys_and_says_how_to_run_it(group, name):
    text = (CONFIGS / group / f"{name}.yaml").read_text()
    assert text.splitlines()[0] == "# @package _global_", "the preset's keys are the config's top-level keys"
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert "Sized for" in header, "say what hardware it was sized for"
    assert not re.search(r"tested on|verified on|measured on", header, re.I), "it has not been run on a GPU"
    assert f"aligner-serve-critic +server_recipe={name}" in header
    assert f"aligner-train +recipe={name}" in header
    cfg = compose("actor" if group == "recipe" else "critic", [f"+{group}={name}"])
    for model in _models_named(cfg):  # presets never download: the header says how to fetch each folder
        assert re.search(rf"hf download \S+ --local-dir models/{re.escape(model)}\b", header), model
    data = cfg.data.dataset if group == "recipe" else None
    if data:  # and how to write the data
        assert data in header, f"the header does not say how to make {data}"


@pytest.mark.parametrize("name", RECIPES)
def test_each_actor_preset_passes_the_actors_checks(name, workspace, monkeypatch):
    """What aligner-train does before it builds anything: the config checked against init_from's
    architecture and tokenizer, and the prompts read (from the stand-in data)."""
    from aligner.actor.model_source import model_keys_named
    from aligner.actor.run import read_inputs

    monkeypatch.chdir(workspace)
    monkeypatch.delenv("ALIGNER_CRITIC_URL", raising=False)
    overrides = [f"+recipe={name}"]
    cfg = OmegaConf.to_object(compose("actor", overrides))
    assert _models_named(compose("actor", overrides)) <= set(MODELS), "add the new model folder to MODELS"
    inputs = read_inputs(cfg, model_keys_named(overrides))
    assert inputs.prompts
    if cfg.validation.interval or cfg.validation.before_train:
        assert inputs.val_prompts
    if cfg.init_from:
        assert cfg.tokenizer == cfg.init_from, "tokenizer: auto takes the model folder's"
        hf = json.loads((workspace / cfg.init_from / "config.json").read_text())
        assert cfg.model.hidden_size == hf.get("hidden_size", hf.get("n_embd")), "the folder's architecture"
    if cfg.data.chat_template:
        assert all(p.startswith("<|system|>") for p in inputs.prompts), inputs.prompts[:1]
    if cfg.data.extra_columns:
        assert all(set(json.loads(x)) == set(cfg.data.extra_columns) for x in inputs.train_extras)


@pytest.mark.parametrize("name", SERVER_RECIPES)
def test_each_server_preset_passes_the_servers_checks(name, workspace, monkeypatch):
    """What aligner-serve-critic does before it builds anything: build_config (the tokenizer
    loads, the reward function imports and takes its arguments, the init folder is a model)."""
    from aligner.critic.config import build_config

    monkeypatch.chdir(workspace)
    dcfg = compose("critic", [f"+server_recipe={name}"])
    assert _models_named(dcfg) <= set(MODELS), "add the new model folder to MODELS"
    build_config(dcfg)


@pytest.mark.parametrize("name", sorted(set(RECIPES) & set(SERVER_RECIPES)))
def test_each_pair_agrees(name, workspace, monkeypatch):
    """The two sides of a preset work together: the same tokenizer, a critic server for GAE and a
    reward-only one for the critic-free estimators, one checkpoint folder, a context that fits."""
    from aligner.actor.model_source import resolve_model_config
    from aligner.critic.config import build_config
    from aligner.rl import CRITIC_FREE_ESTIMATORS
    from aligner.tokenizers import resolve_tokenizer_spec

    monkeypatch.chdir(workspace)
    actor = OmegaConf.to_object(compose("actor", [f"+recipe={name}"]))
    server = build_config(compose("critic", [f"+server_recipe={name}"]))
    assert server.tokenizer == resolve_tokenizer_spec(actor.tokenizer, actor.init_from)
    critic_free = actor.ppo.advantage in CRITIC_FREE_ESTIMATORS
    assert server.mode == ("reward_only" if critic_free else "critic")
    if not critic_free:
        ckpt = actor.checkpoint.dir or f"{actor.logging.run_dir}/checkpoints"
        assert server.checkpoint.dir == ckpt, "both roles save under one folder"
        if server.init.policy_path:
            assert server.init.policy_path == actor.init_from, "the critic starts from the policy"
        else:
            model, _ = resolve_model_config(actor.model, actor.init_from)
            assert server.model.max_seq_len >= model.max_seq_len
    assert server.reward.fn, "a reward function scores the actor's responses"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _changed(preset: DictConfig, packaged: DictConfig) -> dict:
    a = _flat(OmegaConf.to_container(preset, resolve=True))
    b = _flat(OmegaConf.to_container(packaged, resolve=True))
    return {k: v for k, v in a.items() if b.get(k) != v}


def test_the_demo_runs_the_demo_presets_and_only_they_hold_its_settings():
    """examples/demo.py runs recipe/demo and server_recipe/demo, changing only where they write; the
    demo's settings (a learning rate for a tiny model from scratch, 7-token responses, the sort
    reward) live in the presets, and the packaged defaults are a real model's."""
    spec = importlib.util.spec_from_file_location("_demo_example", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.SERVER_OVERRIDES[0] == "+server_recipe=demo" and demo.ACTOR_PRESET == "+recipe=demo"
    where = {"server.grpc_port", "server.metrics_port", "log.dir", "checkpoint.dir"}
    assert {o.split("=")[0] for o in demo.SERVER_OVERRIDES[1:]} <= where

    server = _changed(compose("critic", ["+server_recipe=demo"]), compose("critic", []))
    assert server == {  # server_recipe/digits and where the demo writes
        "model.max_seq_len": 16,
        "optim.lr": 1e-3,
        "reward.fn": "aligner.tasks.digits:sort_reward",
        "log.dir": "runs/demo/critic",
        "checkpoint.dir": "runs/demo/checkpoints",
        "checkpoint.save_on_sigterm": False,
    }
    actor = _changed(compose("actor", ["+recipe=demo"]), compose("actor", []))
    assert actor == {  # recipe/digits and where the demo writes
        "model.max_seq_len": 16,
        "generation.max_new_tokens": 7,
        "optim.lr": 2e-3,
        "optim.min_lr": 2e-3,
        "ppo.micro_batch_size": 64,
        "ppo.ppo_epochs": 2,
        "ppo.init_kl_coef": 0.02,
        "logging.run_dir": "runs/demo/actor",
        "checkpoint.dir": "runs/demo/checkpoints",
        "checkpoint.resume": "none",  # each demo starts over
    }


def test_the_packaged_defaults_are_a_real_models_and_the_dataclasses_say_the_same():
    """aligner-train with init_from and a data set gets verl's quick-start settings, not the CPU
    demo's; the dataclass defaults (what a Python caller gets) are the YAML's."""
    from aligner.actor.config import ActorConfig
    from aligner.critic.config import CriticServerConfig

    actor = compose("actor", [])
    assert (actor.optim.lr, actor.ppo.init_kl_coef, actor.generation.max_new_tokens) == (1e-6, 0.001, 512)
    assert (actor.ppo.global_batch_size, actor.ppo.mini_batch_size, actor.ppo.ppo_epochs) == (256, 64, 1)
    assert compose("critic", []).reward.fn is None, "no demo reward is added to a user's reward model"
    for name, cls in (("actor", ActorConfig), ("critic", CriticServerConfig)):
        assert _changed(OmegaConf.structured(cls()), compose(name, [])) == {}, name


# --- overrides after a preset ------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_a_command_line_override_wins_over_an_actor_preset(name):
    preset = compose("actor", [f"+recipe={name}"])
    for overrides in (
        [f"+recipe={name}", "ppo.num_steps=3", "optim.lr=0.5"],
        ["ppo.num_steps=3", "optim.lr=0.5", f"+recipe={name}"],
    ):
        cfg = compose("actor", overrides)
        assert (cfg.ppo.num_steps, cfg.optim.lr) == (3, 0.5)
        assert cfg.logging.run_dir == preset.logging.run_dir  # the rest is the preset's


@pytest.mark.parametrize("name", SERVER_RECIPES)
def test_a_command_line_override_wins_over_a_server_preset(name):
    preset = compose("critic", [f"+server_recipe={name}"])
    cfg = compose("critic", [f"+server_recipe={name}", "optim.lr=0.5", "server.grpc_port=9001"])
    assert (cfg.optim.lr, cfg.server.grpc_port) == (0.5, 9001)
    assert cfg.log.dir == preset.log.dir and cfg.reward.fn == preset.reward.fn


def test_a_preset_of_the_other_role_is_refused():
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for config, group, name in (
        ("critic", "recipe", "gsm8k_ppo_qwen2.5_0.5b"),
        ("actor", "server_recipe", "gsm8k_ppo_qwen2.5_0.5b"),
    ):
        with pytest.raises((HydraException, OmegaConfBaseException)):
            compose(config, [f"+{group}={name}"])


@pytest.mark.subprocess
def test_the_installed_entry_points_find_the_presets(tmp_path):
    """The real command lines, from a folder outside the repository (the presets come from the
    package, pkg://aligner.configs): the preset's values, and an override after it winning."""
    for module, group, override, expect in (
        ("aligner.actor.run", "recipe", "ppo.num_steps=3", ("num_steps: 3", "init_kl_coef: 0.001")),
        ("aligner.critic.server", "server_recipe", "optim.lr=0.5", ("lr: 0.5", "gsm8k_reward")),
    ):
        out = subprocess.run(
            [sys.executable, "-m", module, f"+{group}=gsm8k_ppo_qwen2.5_0.5b", override, "--cfg", "job"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        for line in expect:
            assert line in out.stdout, (module, line)


# --- the docs ----------------------------------------------------------------------------------------

_PRESET_NAMED = re.compile(r"\+(server_recipe|recipe)=([\w.\-]*[\w\-])")


def test_every_preset_the_docs_name_exists():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(CONFIGS.glob("*/*.yaml"))]:
        for group, name in _PRESET_NAMED.findall(doc.read_text()):
            assert (CONFIGS / group / f"{name}.yaml").is_file(), (
                f"{doc.name} names +{group}={name}: no such preset"
            )
    readme = (ROOT / "README.md").read_text()
    for name in RECIPES:  # and README's "Recipes" table lists every preset
        assert f"| `{name}` |" in readme, f"README.md does not list the preset {name}"


# The entry points of each role, as a command line names them.
ENTRIES = {
    "actor": ("examples/train_actor.py", "aligner-train", "-m aligner.actor.run"),
    "critic": ("servers/serve_critic.py", "aligner-serve-critic", "-m aligner.critic.server"),
}


def readme_commands() -> list[tuple[str, list[str], str]]:
    """(role, overrides, line) of every command line in README.md's code blocks that runs an entry
    point (backslash-continued lines joined; shell variables and placeholders left out)."""
    out = []
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"^```[\w-]*\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if not any(entry.split()[-1] in line for entries in ENTRIES.values() for entry in entries):
                continue
            words = shlex.split(line, comments=True)
            for role, entries in ENTRIES.items():
                for entry in entries:
                    parts = entry.split()
                    at = next(
                        (
                            i
                            for i in range(len(words) - len(parts) + 1)
                            if words[i : i + len(parts)] == parts
                            or (len(parts) == 1 and words[i].endswith("/" + parts[0]))
                        ),
                        None,
                    )
                    if at is None:
                        continue
                    args = words[at + len(parts) :]
                    overrides = [
                        w
                        for w in args
                        if "=" in w and not w.startswith("-") and "$" not in w and "<" not in w
                    ]
                    out.append((role, overrides, line.strip()))
    return out


def test_readme_has_command_lines_to_check():
    roles = {role for role, _, _ in readme_commands()}
    assert roles == {"actor", "critic"}


@pytest.mark.parametrize(
    "role, overrides, line",
    [pytest.param(*c, id=f"{c[0]}-{i}") for i, c in enumerate(readme_commands())],
)
def test_readme_command_lines_use_real_keys(role, overrides, line):
    """Unknown keys, a ``+`` on a key that exists, a wrong type: what the entry point would refuse."""
    try:
        cfg = compose(role, overrides)
    except Exception as e:  # Hydra's and OmegaConf's errors name the key
        pytest.fail(f"README.md: {line}\n  {type(e).__name__}: {e}")
    for o in overrides:
        key = o.split("=", 1)[0]
        if not key.startswith("+"):
            assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", (key, line)
