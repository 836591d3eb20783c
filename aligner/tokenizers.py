"""Tokenizers: a built-in character vocabulary for the embedded tasks, and HF tokenizers from a
local folder. Both expose the same small interface the rest of the project uses."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Protocol, runtime_checkable

__all__ = [
    "Tokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "resolve_tokenizer_spec",
    "has_tokenizer_files",
    "generation_eos_ids",
    "DIGITS",
]

DIGITS = "0123456789"


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    """Rows of the embedding the tokenizer can produce ids for."""
    sample_vocab_size: int
    """Ids at or above this are never generated (a pad id kept out of the action space)."""
    pad_id: int
    eos_id: int
    """The primary end-of-sequence id: appended and used for padding where one id is needed."""
    stop_ids: tuple[int, ...]
    """Every id that ends a response, ``eos_id`` first (an instruct model's several end ids)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...

    def fingerprint(self) -> str: ...


class CharTokenizer:
    """One token per character of a fixed alphabet, plus ``<eos>`` (id 0) and ``<pad>`` (the
    last id).

    Pad and end-of-sequence are distinct so that a policy learns to stop and padding is never
    mistaken for a stop. Pad is the last id so that ``sample_vocab_size`` can exclude it: a
    policy never emits padding (engines sample, and trainers normalise, over the ids below
    ``sample_vocab_size`` only), which keeps a tiny random policy from wasting probability on it.
    """

    PAD, EOS = "<pad>", "<eos>"

    def __init__(self, alphabet: str = DIGITS + ":,") -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet={alphabet!r}: characters must be distinct")
        if not alphabet:
            raise ValueError("alphabet is empty: expected at least one character")
        self.alphabet = alphabet
        self.eos_id = 0
        self._to_id = {c: i + 1 for i, c in enumerate(alphabet)}
        self.pad_id = len(alphabet) + 1
        self.vocab_size = len(alphabet) + 2
        self.sample_vocab_size = self.vocab_size - 1
        self.stop_ids = (self.eos_id,)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} in {text!r} is not in the tokenizer alphabet {self.alphabet!r}"
            ) from None

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (self.pad_id, self.eos_id):
                if not skip_special:
                    out.append(self.PAD if i == self.pad_id else self.EOS)
                continue
            if not 1 <= i < self.pad_id:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            out.append(self.alphabet[i - 1])
        return "".join(out)

    def fingerprint(self) -> str:
        return "char:" + hashlib.sha256(self.alphabet.encode()).hexdigest()[:16]

    def has_chat_template(self) -> bool:
        """Always false: a character vocabulary has no chat format."""
        return False

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs) -> str:
        """Refused: there is no template to apply."""
        raise ValueError(f"{self!r} has no chat template: use a HF tokenizer folder that has one")

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r})"


class HFTokenizer:
    """A ``transformers`` tokenizer loaded from a local folder (never downloaded).

    ``stop_ids``: the tokenizer's eos, then the ``eos_token_id`` (an int or a list, as instruct
    models write several: Qwen2.5's ``[151645, 151643]``) of the ``generation_config.json`` in
    ``path`` and in ``model_folder`` (the policy's folder, when the tokenizer comes from another
    one). A tokenizer without an eos token takes the first of those as ``eos_id``."""

    def __init__(self, path: str, model_folder: str | os.PathLike | None = None) -> None:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer folder {path!r} does not exist")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many types here
            raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
        self.path = path
        self.vocab_size = len(self.hf)
        folders = [path]
        if model_folder and os.path.realpath(model_folder) != os.path.realpath(path):
            folders.append(str(model_folder))
        config_ids = [i for folder in folders for i in generation_eos_ids(folder, self.vocab_size)]
        if self.hf.eos_token_id is None and not config_ids:
            raise ValueError(
                f"tokenizer in {path!r} has no eos_token (and no generation_config.json names an "
                "eos_token_id): expected one for generation to stop"
            )
        self.eos_id = int(self.hf.eos_token_id) if self.hf.eos_token_id is not None else config_ids[0]
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *config_ids]))
        # Many causal LM tokenizers have no pad token; padding positions are masked anyway.
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        self.sample_vocab_size = self.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def has_chat_template(self) -> bool:
        """Whether the folder's tokenizer carries a chat template (chat and instruct models do)."""
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs) -> str:
        """``messages`` ([{"role": ..., "content": ...}, ...]) as the text of a prompt that ends
        where the assistant's reply begins (the template's generation prompt); encode it with
        :meth:`encode`, whose special tokens the text already holds. ``kwargs`` reach the
        template as variables (``data.chat_template_kwargs``: Qwen3's ``enable_thinking=False``)."""
        if not self.has_chat_template():
            raise ValueError(
                f"{self!r} has no chat template (its tokenizer_config.json sets no chat_template)"
            )
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def fingerprint(self) -> str:
        vocab = self.hf.get_vocab()
        blob = json.dumps(sorted(vocab.items()), separators=(",", ":")).encode()
        return "hf:" + hashlib.sha256(blob).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


GENERATION_CONFIG = "generation_config.json"
"""A Hugging Face model folder's generation defaults, whose ``eos_token_id`` lists the end ids."""


def generation_eos_ids(folder: str | os.PathLike, vocab_size: int | None = None) -> list[int]:
    """The ``eos_token_id`` (an int, a list of ints, or absent) of ``folder``'s
    ``generation_config.json``, as a list ([] without the file or the key).

    Raises:
        ValueError: naming the file, when it is not JSON or an id is not an integer in
            ``[0, vocab_size)``.
    """
    file = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.isfile(file):
        return []
    try:
        with open(file, encoding="utf-8") as f:
            ids = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{file}: cannot read eos_token_id: {e}") from e
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    limit = vocab_size if vocab_size is not None else float("inf")
    for i in ids:
        if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < limit):
            raise ValueError(
                f"{file}: eos_token_id={ids!r}: expected an id or a list of ids in [0, {vocab_size}) "
                "(the tokenizer's vocabulary)"
            )
    return list(ids)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Files of which any one marks a folder as holding a Hugging Face tokenizer."""


def has_tokenizer_files(folder: str | os.PathLike | None) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer's files."""
    return bool(folder) and any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def resolve_tokenizer_spec(spec: str, model_folder: str | os.PathLike | None = None) -> str:
    """``auto``: ``model_folder``'s tokenizer when it holds one (a policy's ``init_from``), ``char``
    without a model folder; any other spec as it is.

    Raises:
        ValueError: ``auto`` with a model folder that holds no tokenizer files (this project's
            checkpoints do not): which tokenizer the weights were trained with must be said.
    """
    if spec != "auto":
        return spec
    if not model_folder:
        return "char"
    if has_tokenizer_files(model_folder):
        return str(model_folder)
    raise ValueError(
        f"tokenizer=auto: init_from={str(model_folder)!r} holds no tokenizer files "
        f"(none of {list(TOKENIZER_FILES)}); set tokenizer to the HF tokenizer folder the policy was "
        "trained with, or tokenizer=char for the built-in vocabulary"
    )


def build_tokenizer(spec: str, model_folder: str | os.PathLike | None = None) -> Tokenizer:
    """``char`` (digits plus ':' and ','), ``char:<alphabet>``, a path to a HF tokenizer folder, or
    ``auto`` (:func:`resolve_tokenizer_spec` with ``model_folder``). A HF tokenizer's stop ids
    also come from ``model_folder``'s ``generation_config.json`` (:class:`HFTokenizer`)."""
    spec = resolve_tokenizer_spec(spec, model_folder)
    if spec == "char":
        return CharTokenizer()
    if spec.startswith("char:"):
        return CharTokenizer(spec[len("char:") :])
    if os.path.isdir(spec):
        return HFTokenizer(spec, model_folder)
    raise ValueError(
        f"tokenizer={spec!r}: expected 'char', 'char:<alphabet>', 'auto' or an existing HF tokenizer folder"
    )
