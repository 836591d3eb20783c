"""The shared inputs of the TRL comparison: the benchmark shapes (:data:`CASES`), the PPO
hyperparameters both systems take, and the files both load (one tokenizer folder, the policy's
and the reward model's HF folders, one prompt file), written once per case by
:func:`build_inputs`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Case:
    """One benchmark shape."""

    name: str
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    ffn: int = 680
    vocab: int = 512
    batch: int = 64
    prompt_len: int = 16
    new_tokens: int = 48
    ppo_epochs: int = 4

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.new_tokens


CASES = {
    "B1": Case("B1", new_tokens=48, ppo_epochs=4),
    "B2": Case("B2", new_tokens=192, ppo_epochs=1),
    # A miniature for the smoke test: seconds, not minutes.
    "mini": Case("mini", layers=1, hidden=32, heads=2, ffn=64, vocab=64, batch=4, prompt_len=4, new_tokens=4),
}

LR = 3e-6
KL_COEF = 0.05


# -- shared inputs --------------------------------------------------------------------------


def build_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level HF tokenizer of exactly ``vocab`` ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
    ``<unk>`` 3, then ``t4`` .. ``t{vocab-1}``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    ids = {t: i for i, t in enumerate(specials)}
    ids.update({f"t{i}": i for i in range(len(specials), vocab)})
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    fast.save_pretrained(str(folder))


def model_config(case: Case):
    from aligner.models.config import ModelConfig

    return ModelConfig(
        num_layers=case.layers,
        hidden_size=case.hidden,
        num_attention_heads=case.heads,
        ffn_hidden_size=case.ffn,
        vocab_size=case.vocab,
        max_seq_len=case.max_seq_len,
    )


def build_inputs(case: Case, root: Path, seed: int = 0) -> dict[str, str]:
    """Tokenizer, policy and reward HF folders and a prompt file for ``case`` under ``root``."""
    import torch
    import transformers

    from aligner.models.hf_config import hf_config_from_model_config

    root.mkdir(parents=True, exist_ok=True)
    paths = {k: str(root / k) for k in ("tokenizer", "policy", "reward")}
    paths["prompts"] = str(root / "prompts.jsonl")
    build_tokenizer(Path(paths["tokenizer"]), case.vocab)
    cfg = model_config(case)
    ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    for role, arch, s in (
        ("policy", "LlamaForCausalLM", seed),
        ("reward", "LlamaForSequenceClassification", seed + 1),
    ):
        hcfg = hf_config_from_model_config(cfg, arch, base=ids)
        torch.manual_seed(s)
        model = getattr(transformers, arch)(hcfg).float()
        model.save_pretrained(paths[role])
    g = torch.Generator().manual_seed(seed + 2)
    # Enough prompts that no update repeats a prompt batch.
    n = case.batch * 64
    words = torch.randint(4, case.vocab, (n, case.prompt_len), generator=g).tolist()
    with open(paths["prompts"], "w") as f:
        for row in words:
            f.write(json.dumps({"prompt": " ".join(f"t{i}" for i in row)}) + "\n")
    return paths
