"""The ``limits`` section of the critic server's configuration (:mod:`aligner.critic.config`):
how large one critic_infer request may be beyond its shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aligner.wire.protocol import InputLimits

__all__ = ["LimitsConfig"]


@dataclass
class LimitsConfig:
    """How large a critic_infer request may be beyond its shapes, checked per request before
    anything is decoded or parsed; a request over one is refused naming the key. Rows per
    request: ``server.max_batch_size``."""

    max_extras_bytes: int = InputLimits.max_extras_bytes
    """Most bytes of one sample's ``extras`` (its extra data-set columns as one JSON object)."""
    max_text_bytes: int = InputLimits.max_text_bytes
    """Most bytes of one sample's ``prompt_text`` or ``response_text``."""
    max_input_bytes: int = InputLimits.max_input_bytes
    """Most bytes of one text input of a request, all its rows together."""
    max_json_depth: int = InputLimits.max_json_depth
    """Deepest nesting of arrays and objects in one sample's ``extras`` (its object is depth 1)."""
    max_extras_keys: int = InputLimits.max_extras_keys
    """Most keys of one sample's ``extras``, and most columns over a request's samples (each is a
    keyword argument of the reward function)."""
    reward_only_max_seq_len: int = 32768
    """Longest padded sample (tokens) of a ``mode=reward_only`` server whose length nothing else
    bounds (no reward model on the policy's ids); with a critic, the model's ``max_seq_len``."""

    def input_limits(self) -> InputLimits:
        """The text-input limits, as the wire protocol's checks take them."""
        return InputLimits(
            max_extras_bytes=self.max_extras_bytes,
            max_text_bytes=self.max_text_bytes,
            max_input_bytes=self.max_input_bytes,
            max_json_depth=self.max_json_depth,
            max_extras_keys=self.max_extras_keys,
        )

    def problems(self, prefix: str) -> list[str]:
        """Every value below 1, named."""
        return [
            f"{prefix}.{f.name}={getattr(self, f.name)!r}: expected an integer >= 1"
            for f in dataclasses.fields(self)
            if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1
        ]
