"""The ``README.md`` of an exported policy: a Hugging Face model card (YAML front matter that the
Hub reads: ``base_model``, ``library_name: transformers``, ``tags``) naming how the policy was
trained (the run's recipe and command-line overrides, its main settings) and its metrics at the
exported step. Whatever is unknown (a run without metrics, an export of a bare model checkpoint)
is left out, never guessed."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["model_card", "CARD_SETTINGS", "CARD_METRIC_PREFIXES"]

CARD_SETTINGS: tuple[str, ...] = (
    "init_from",
    "tokenizer",
    "data.task",
    "data.dataset",
    "data.prompt_file",
    "ppo.advantage",
    "ppo.num_steps",
    "ppo.global_batch_size",
    "ppo.samples_per_prompt",
    "ppo.init_kl_coef",
    "ppo.kl_estimator",
    "optim.lr",
    "lora.rank",
    "lora.alpha",
    "generation.max_new_tokens",
    "generation.temperature",
    "precision",
    "seed",
)
"""The config keys a card lists (those the run's config has)."""

CARD_METRIC_PREFIXES: tuple[str, ...] = ("objective/", "validation/")
"""The metrics a card lists: the rewards, KL and validation scores."""


def _get(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _yaml_str(v: str) -> str:
    return json.dumps(v)  # a JSON string is a YAML string


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return f"`{v}`" if isinstance(v, str) else str(v)


def model_card(
    *,
    title: str,
    base_model: str | None = None,
    what: str = "",
    config: Mapping[str, Any] | None = None,
    overrides: Sequence[str] | None = None,
    metrics: Mapping[str, Any] | None = None,
    step: int | None = None,
    extra_tags: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> str:
    """The card's text. ``what``: a sentence on what was exported (the final step, the best
    validation step, ...); ``config``: the run's resolved config (``run_config.json``'s, or a
    checkpoint's ``trainer_state.json``'s); ``overrides``: its command line (``+recipe=...``);
    ``metrics``: the latest value of each metric at the exported step."""
    tags = ["rlhf", "ppo", *[t for t in extra_tags if t not in ("rlhf", "ppo")]]
    front = ["---"]
    if base_model:
        front.append(f"base_model: {_yaml_str(base_model)}")
    front += ["library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    front += [f"- {_yaml_str(t)}" for t in tags]
    front.append("---")
    lines = [*front, "", f"# {title}", ""]
    intro = "A policy trained with reinforcement learning from feedback (aligner: PPO on Megatron-core)"
    if base_model:
        intro += f", starting from `{base_model}`"
    lines.append(intro + ".")
    if what:
        lines += ["", what]
    lines += ["", "Load it with `transformers.AutoModelForCausalLM.from_pretrained(<this folder>)`."]
    if overrides:
        recipes = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")]
        lines += ["", "## Recipe", ""]
        if recipes:
            lines.append(f"Recipe: `{recipes[0]}` (`aligner/configs/recipe/{recipes[0]}.yaml`).")
            lines.append("")
        lines.append("Command-line overrides:")
        lines += ["", "```", *overrides, "```"]
    settings = [(k, _get(config, k)) for k in CARD_SETTINGS] if config else []
    lora = bool(_get(config, "lora.rank")) if config else False
    settings = [
        (k, v)
        for k, v in settings
        if (v not in (None, "", 0) or k == "ppo.init_kl_coef") and (lora or not k.startswith("lora."))
    ]
    if settings:
        lines += ["", "## Training settings", "", "| setting | value |", "| --- | --- |"]
        lines += [f"| `{k}` | {_fmt(v)} |" for k, v in settings]
    shown = sorted(
        (k, v)
        for k, v in (metrics or {}).items()
        if k.startswith(CARD_METRIC_PREFIXES) and isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    if shown:
        at = f" (step {step})" if step is not None else ""
        lines += ["", f"## Metrics at export{at}", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| `{k}` | {_fmt(float(v))} |" for k, v in shown]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"
