"""Load → quantize → save → load: the only code that mutates models, and the payloads it writes."""

from floatxq.lifecycle.checkpoint import CheckpointError
from floatxq.lifecycle.evaluate import EvalReport, evaluate_lm
from floatxq.lifecycle.gptq import gptq_solve_options
from floatxq.lifecycle.inspect import CheckpointReport, inspect_checkpoint
from floatxq.lifecycle.model import QuantizedModel, load
from floatxq.lifecycle.payload import (
    fp8_config_from_payload,
    fp8_config_to_payload,
    gptq_config_from_payload,
    gptq_config_to_payload,
    payload_format,
    payload_method,
)

__all__ = [
    "CheckpointError",
    "CheckpointReport",
    "EvalReport",
    "QuantizedModel",
    "evaluate_lm",
    "fp8_config_from_payload",
    "fp8_config_to_payload",
    "gptq_config_from_payload",
    "gptq_config_to_payload",
    "gptq_solve_options",
    "inspect_checkpoint",
    "load",
    "payload_format",
    "payload_method",
]
