"""A word-level Hugging Face tokenizer folder for tests (one token per word, no download): the
specials first (``<pad>``, ``<unk>``, ``</s>``, then ones added as special tokens), eos ``</s>``."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SPECIALS = ("<pad>", "<unk>", "</s>", "<|user|>", "<|system|>", "<|assistant|>")


def save_word_tokenizer(
    folder: str | Path, words: list[str], template: str | None = None, specials=DEFAULT_SPECIALS
) -> Path:
    """Write the tokenizer of ``specials + words`` (ids in that order) to ``folder``, with the
    chat ``template`` if given; returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = list(specials)
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + list(words))}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": specials[3:]})
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return Path(folder)
