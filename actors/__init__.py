"""Ray actors of the asynchronous pipeline: thin shells that hold state, move data and call ``distillspec``."""

from actors.evaluator import EvalActor
from actors.prompts import PromptLog
from actors.rollout import RolloutActor, ScorerActor
from actors.stores import BufferActor, WeightStore

__all__ = ["BufferActor", "EvalActor", "PromptLog", "RolloutActor", "ScorerActor", "WeightStore"]
