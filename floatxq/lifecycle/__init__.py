"""Load → quantize → save → load: the only code that mutates models."""

from floatxq.lifecycle.checkpoint import CheckpointError
from floatxq.lifecycle.evaluate import EvalReport, evaluate_lm
from floatxq.lifecycle.inspect import CheckpointReport, inspect_checkpoint
from floatxq.lifecycle.model import QuantizedModel, load

__all__ = [
    "CheckpointError",
    "CheckpointReport",
    "EvalReport",
    "QuantizedModel",
    "evaluate_lm",
    "inspect_checkpoint",
    "load",
]
