"""Named presets: plain functions returning the root config dataclass."""

from meshrl.configs.presets import PRESETS, tiny_reverse

__all__ = ["PRESETS", "tiny_reverse"]
