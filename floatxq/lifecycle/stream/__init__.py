"""The W4A activation stream: activations packed once at a module boundary and handed on.

Without the stream every W4A linear quantizes its own input, call by call. With it, each GEMM
operand is packed once into a :class:`~floatxq.W4AActivation` carrier and handed to every
module that reads it, through one hand-off (:mod:`.boundary`): a producer marks a tensor, each
projection's pre-hook finds its operand by the identity of its input. Two producers:

- :func:`install_w4a_stream` (:mod:`.boundary`), any decoder whose norms feed its W4A linears:
  a norm's output, in the model dtype, packed by its first consumer with that linear's own
  ``activation_global_scale`` (else dynamic) and shared by the others of its lane and scale.
- :func:`install_w4a_llama_stream` (:mod:`.install`, dataflow in :mod:`.llama`), Llama layers:
  the residual stays in FP32 between layers and the layer packs the norm operand itself from
  it (``1/rms`` in FP32; with ``fused_norms`` the residual's codes with token scales, so no
  norm output exists to hook); the projections' hooks are per call, since the same dataflow
  runs the GPTQ replay's FP32 codec. Five boundaries per layer
  (:func:`llama_stream_boundaries`); the calibrated producer scales are int32 buffers of a
  :class:`StreamScales` registered on each layer as ``w4a_stream_scales`` (in ``state_dict``;
  the exporters leave them to the policy's ``global_scales``).

NVFP4 global scales: a calibrated producer scale; else, with a ``*_headroom`` recipe, the
consuming linear's ``activation_global_scale``; else the dynamic one of ``max|x|``. ``lm_head``,
the embeddings and the KV cache stay in the model dtype. On CUDA the carriers come from the
Triton packers with no host read; on the CPU from :func:`floatxq.pack_activation`. The Llama
dataflow, per layer (derivation and the two producers compared in
``docs/activation-policies.md``)::

    x = input carrier; a = pack(rmsnorm(x)); q, k, v = q/k/v_proj(a); o = pack(attention)
    r1 = x (FP32) + o_proj(o); b = pack(rmsnorm(r1)); d = pack(act(gate(b)) * up(b))
    r2 = r1 + down_proj(d) -> the output carrier
"""

from floatxq.lifecycle.stream.boundary import install_w4a_stream, uninstall_w4a_stream
from floatxq.lifecycle.stream.codec import NVFP4BoundaryQuantizer, StreamScales
from floatxq.lifecycle.stream.install import (
    install_w4a_llama_stream,
    installed_w4a_stream,
    set_stream_global_scales,
    stream_boundary_quantizers,
    uninstall_w4a_llama_stream,
)
from floatxq.lifecycle.stream.plan import (
    LLAMA_STREAM_PROJECTIONS,
    StreamBoundary,
    StreamLane,
    StreamLayerPlan,
    W4AStreamPolicy,
    llama_stream_boundaries,
    stream_lane,
    stream_layer_plans,
    stream_producer_keys,
    validate_producer_scales,
    w4a_stream_policy,
)

__all__ = [
    "LLAMA_STREAM_PROJECTIONS",
    "NVFP4BoundaryQuantizer",
    "StreamBoundary",
    "StreamLane",
    "StreamLayerPlan",
    "StreamScales",
    "W4AStreamPolicy",
    "install_w4a_llama_stream",
    "install_w4a_stream",
    "installed_w4a_stream",
    "llama_stream_boundaries",
    "set_stream_global_scales",
    "stream_boundary_quantizers",
    "stream_lane",
    "stream_layer_plans",
    "stream_producer_keys",
    "uninstall_w4a_llama_stream",
    "uninstall_w4a_stream",
    "validate_producer_scales",
    "w4a_stream_policy",
]
