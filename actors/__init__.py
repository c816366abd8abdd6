"""Monarch actors. Thin: each endpoint validates its input, calls library code, returns plain data."""

from meshrl.actors.generator import Generator
from meshrl.actors.policy_trainer import PolicyTrainer
from meshrl.actors.reference import ReferenceModel
from meshrl.actors.reward import RewardActor

__all__ = ["Generator", "PolicyTrainer", "ReferenceModel", "RewardActor"]
