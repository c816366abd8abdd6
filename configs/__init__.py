"""Named presets: plain functions returning the root config dataclass."""

from meshrl.configs.presets import PRESETS, SFT_PRESETS, tiny_reverse, tiny_reverse_sft

__all__ = ["PRESETS", "SFT_PRESETS", "tiny_reverse", "tiny_reverse_sft"]
