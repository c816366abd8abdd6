"""Named presets: plain functions returning the root config dataclass."""

from meshrl.configs.presets import (
    EVAL_PRESETS,
    PRESETS,
    SFT_PRESETS,
    presets_for,
    tiny_math,
    tiny_reverse,
    tiny_reverse_sft,
)

__all__ = ["EVAL_PRESETS", "PRESETS", "SFT_PRESETS", "presets_for", "tiny_math", "tiny_reverse", "tiny_reverse_sft"]
