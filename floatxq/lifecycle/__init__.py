"""Load → quantize → save → load: the only code that mutates models. The files, layouts and
payloads it reads and writes are :mod:`floatxq.interop`'s, re-exported here."""

from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.export import (
    CHECKPOINT_LAYOUTS,
    DEFAULT_LAYOUT,
    CheckpointLayout,
    LayoutExport,
    export_layout,
    normalize_layout,
)
from floatxq.interop.inspect import CheckpointReport, inspect_checkpoint
from floatxq.interop.layouts import (
    READ_LAYOUTS,
    SCALE_CONVENTIONS,
    LayoutDecision,
    decide_layout,
)
from floatxq.interop.payload import (
    fp8_config_from_payload,
    fp8_config_to_payload,
    gptq_config_from_payload,
    gptq_config_to_payload,
    nvfp4_config_from_payload,
    nvfp4_config_to_payload,
    payload_format,
    payload_method,
)
from floatxq.lifecycle.activation_summary import activation_summary
from floatxq.lifecycle.calibration import load_calibration_file, prepare_calibration
from floatxq.lifecycle.distributed import torchrun_setup
from floatxq.lifecycle.evaluate import EvalReport, evaluate_lm
from floatxq.lifecycle.gptq import gptq_solve_options
from floatxq.lifecycle.layout_check import check_layout
from floatxq.lifecycle.loading import load, resolve_model
from floatxq.lifecycle.model import InterruptedQuantize, QuantizedModel
from floatxq.lifecycle.stream import (
    NVFP4BoundaryQuantizer,
    W4AStreamPolicy,
    install_w4a_llama_stream,
    install_w4a_stream,
    installed_w4a_stream,
    llama_stream_boundaries,
    set_stream_global_scales,
    stream_boundary_quantizers,
    uninstall_w4a_llama_stream,
    uninstall_w4a_stream,
    w4a_stream_policy,
)

__all__ = [
    "CHECKPOINT_LAYOUTS",
    "DEFAULT_LAYOUT",
    "READ_LAYOUTS",
    "SCALE_CONVENTIONS",
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointReport",
    "EvalReport",
    "InterruptedQuantize",
    "LayoutDecision",
    "LayoutExport",
    "NVFP4BoundaryQuantizer",
    "QuantizedModel",
    "W4AStreamPolicy",
    "activation_summary",
    "check_layout",
    "decide_layout",
    "evaluate_lm",
    "export_layout",
    "fp8_config_from_payload",
    "fp8_config_to_payload",
    "gptq_config_from_payload",
    "gptq_config_to_payload",
    "gptq_solve_options",
    "inspect_checkpoint",
    "install_w4a_llama_stream",
    "install_w4a_stream",
    "installed_w4a_stream",
    "llama_stream_boundaries",
    "load",
    "load_calibration_file",
    "normalize_layout",
    "nvfp4_config_from_payload",
    "nvfp4_config_to_payload",
    "payload_format",
    "payload_method",
    "prepare_calibration",
    "resolve_model",
    "set_stream_global_scales",
    "stream_boundary_quantizers",
    "torchrun_setup",
    "uninstall_w4a_llama_stream",
    "uninstall_w4a_stream",
    "w4a_stream_policy",
]
