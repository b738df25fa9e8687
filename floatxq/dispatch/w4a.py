"""W4A routes: the W4A-FP8 and W4A-NVFP4 GEMMs, the NVFP4 accumulator, the activation packers."""

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from floatxq._typing import Float, Shaped, Tensor
from floatxq.dispatch.preference import W4A_FP8_ROUTES, W4A_NVFP4_ROUTES
from floatxq.formats import MODEL_DTYPES, NVFP4RecipeName, W4AActivationMode
from floatxq.kernels._triton import (
    capability_shortfall,
    triton_interpret_enabled,
    triton_unavailable_reason,
)
from floatxq.kernels.nvfp4 import DEFAULT_NVFP4_TUNING, NVFP4Tuning
from floatxq.kernels.w4a_fp8 import (
    DEFAULT_W4A_FP8_TUNING,
    W4AFP8Route,
    W4AFP8Tuning,
    blockwise_unavailable_reason,
)
from floatxq.kernels.w4a_frag import DEFAULT_FRAG_TUNING, FragTuning, fragment_unavailable_reason
from floatxq.w4a import activation as _activation
from floatxq.w4a.activation import W4AActivation
from floatxq.w4a.linear import w4a_nvfp4_accumulate_group

__all__ = [
    "ROWS_BUCKET_EXACT",
    "fp8_pack_reason",
    "nvfp4_accumulator",
    "nvfp4_operand",
    "nvfp4_pack_reason",
    "pack_activation",
    "rows_bucket",
    "stream_pack_reason",
    "w4a_fp8_carrier_route",
    "w4a_fp8_gemm_route",
    "w4a_fp8_operand",
    "w4a_fp8_route",
    "w4a_fp8_weight",
    "w4a_fp8_words",
    "w4a_nvfp4_native_unavailable_reason",
    "w4a_nvfp4_route",
]

_NATIVE_MIN_CAPABILITY = (12, 1)

ROWS_BUCKET_EXACT = 128
"""Row counts up to this are their own class for the route choices (every row-count threshold
of the default tunings lies at or below it)."""


def rows_bucket(rows: int) -> int:
    """The class of a row count for the INT4 route choices, so a module can keep one decision
    per class: ``rows`` itself up to :data:`ROWS_BUCKET_EXACT`, above it one class per residue
    mod 4 (cuBLAS's blockwise GEMM needs a multiple of 4 rows). Two row counts of one class get
    the same routes from :func:`w4a16_route`, :func:`w4a_fp8_operand` and
    :func:`w4a_fp8_gemm_route` under the default tunings.

    Example:
      >>> rows_bucket(7), rows_bucket(4096) == rows_bucket(132), rows_bucket(4097) == rows_bucket(8)
      (7, True, False)
    """
    return rows if rows <= ROWS_BUCKET_EXACT else ROWS_BUCKET_EXACT + 1 + rows % 4


def _w4a_fp8_unavailable(device: torch.device) -> str | None:
    """The W4A-FP8 kernels' own reason they cannot run on ``device``, or why they do not
    import."""
    try:
        from floatxq.kernels.w4a_fp8 import w4a_fp8_unavailable_reason
    except ImportError as exc:  # pragma: no cover - the kernels ship with floatxq
        return f"floatxq.kernels.w4a_fp8 does not import ({exc})"
    return w4a_fp8_unavailable_reason(device)


def _nvfp4_emulation_unavailable(device: torch.device) -> str | None:
    """The NVFP4 emulation kernels' own reason they cannot run on ``device``, or why they do
    not import."""
    try:
        from floatxq.kernels.nvfp4 import nvfp4_unavailable_reason
    except ImportError as exc:
        return f"floatxq.kernels.nvfp4 does not import ({exc})"
    return nvfp4_unavailable_reason(device)


def w4a_fp8_route(requested: str, device: torch.device) -> tuple[str, str | None]:
    """The W4A-FP8 route a call on ``device`` takes, and why the kernels were not taken.

    Args:
      requested: ``"auto"``, ``"triton"`` or ``"reference"``.
      device: where the call's tensors are.

    Returns:
      ``("triton", None)`` where the kernels run (``"auto"`` or ``"triton"``), else
      ``("reference", why)``.

    Raises:
      ValueError: an unknown ``requested``.
      RuntimeError: ``"triton"`` requested where the kernels cannot run (the reason named).

    Example:
      >>> w4a_fp8_route("reference", torch.device("cpu"))
      ('reference', "route='reference' was requested")
    """
    if requested not in W4A_FP8_ROUTES:
        raise ValueError(f"W4AFP8Linear: route must be one of {W4A_FP8_ROUTES}, got {requested!r}")
    if requested == "reference":
        return "reference", "route='reference' was requested"
    reason = _w4a_fp8_unavailable(device)
    if reason is None:
        return "triton", None
    if requested == "triton":
        raise RuntimeError(f"W4AFP8Linear: route='triton' cannot run on {device}: {reason}")
    return "reference", reason


def w4a_fp8_carrier_route(requested: str, device: torch.device) -> tuple[str, str | None]:
    """The route of an FP8 carrier through ``W4ANVFP4Linear`` (``requested`` its NVFP4 route):
    ``"fp8_triton"`` where the W4A-FP8 kernels run and ``"reference"`` was not requested, else
    ``"fp8_reference"`` and why.

    Example:
      >>> w4a_fp8_carrier_route("reference", torch.device("cpu"))
      ('fp8_reference', "route='reference' was requested")
    """
    if requested == "reference":
        return "fp8_reference", "route='reference' was requested"
    reason = _w4a_fp8_unavailable(device)
    return ("fp8_triton", None) if reason is None else ("fp8_reference", reason)


def w4a_fp8_operand(
    rows: int,
    tuning: W4AFP8Tuning = DEFAULT_W4A_FP8_TUNING,
    *,
    decode_words: bool = False,
    fragment: bool = False,
    frag_tuning: FragTuning = DEFAULT_FRAG_TUNING,
) -> Literal["fragment", "decode_words", "words", "e4m3"]:
    """Which weight form an ``rows``-row W4A-FP8 GEMM reads fastest: the fragment words (the
    decoded weights as the MMA's register operand, :mod:`floatxq.kernels.w4a_frag`) up to
    ``frag_tuning.w4a_fp8_max_rows`` rows where the caller holds them and they run
    (``fragment``), the int16 decode words (half a byte per weight, decoded two per
    instruction) up to ``tuning.dwords_max_rows`` rows where the caller holds them
    (``decode_words``), the int32 checkpoint words (also half a byte) up to
    ``tuning.words_max_rows``, else the staged E4M3 operand (the FP8 tensor cores). All give
    the same sums up to FP32 order.

    Example:
      >>> w4a_fp8_operand(1), w4a_fp8_operand(1, decode_words=True), w4a_fp8_operand(4096)
      ('words', 'decode_words', 'e4m3')
      >>> w4a_fp8_operand(4, fragment=True), w4a_fp8_operand(5, decode_words=True, fragment=True)
      ('fragment', 'decode_words')
    """
    if fragment and rows <= frag_tuning.w4a_fp8_max_rows:
        return "fragment"
    if decode_words and rows <= tuning.dwords_max_rows:
        return "decode_words"
    return "words" if rows <= tuning.words_max_rows else "e4m3"


def w4a_fp8_words(
    rows: int,
    fragment: Shaped[Tensor, "rows n"] | None,
    decode_words: Shaped[Tensor, "rows n"] | None,
    words: Shaped[Tensor, "packed n"],
) -> tuple[Tensor, Literal["fragment", "triton"]] | None:
    """``(weight, GEMM route)`` where an ``rows``-row W4A-FP8 call reads packed words — the
    fragment words (where held and :func:`~floatxq.kernels.w4a_frag.fragment_unavailable_reason`
    names no reason for their device), the decode words (where held) or the checkpoint's int32
    ``words`` — by :func:`w4a_fp8_operand`; None where the staged E4M3 operand is faster.

    Example:
      >>> w = torch.zeros(16, 32, dtype=torch.int32)
      >>> w4a_fp8_words(1, None, None, w)[1], w4a_fp8_words(4096, None, None, w)
      ('triton', None)
    """
    runs = fragment is not None and fragment_unavailable_reason(fragment.device) is None
    form = w4a_fp8_operand(rows, decode_words=decode_words is not None, fragment=runs)
    held = {"fragment": fragment, "decode_words": decode_words, "words": words}
    chosen = held.get(form)
    if chosen is None:
        return None
    return chosen, "fragment" if form == "fragment" else "triton"


def w4a_fp8_gemm_route(
    rows: int,
    weight: Shaped[Tensor, "rows n"],
    tuning: W4AFP8Tuning = DEFAULT_W4A_FP8_TUNING,
) -> tuple[W4AFP8Route, str | None]:
    """``(route, reason)``: the GEMM an ``rows``-row W4A-FP8 call on ``weight`` takes, and why
    not cuBLAS.

    ``"scaled_mm_blockwise"`` (cuBLAS's blockwise FP8 GEMM) from ``tuning.cublas_min_rows`` rows
    on, where :func:`floatxq.kernels.w4a_fp8.blockwise_unavailable_reason` names no reason;
    else ``"triton"`` with the reason. Both routes meet the same bound.

    Example:
      >>> w4a_fp8_gemm_route(1, torch.zeros(16, 32, dtype=torch.int32))
      ('triton', '1 rows < 128: the Triton GEMM is faster')
    """
    if rows < tuning.cublas_min_rows:
        return "triton", f"{rows} rows < {tuning.cublas_min_rows}: the Triton GEMM is faster"
    reason = blockwise_unavailable_reason(rows, weight)
    return ("triton", reason) if reason is not None else ("scaled_mm_blockwise", None)


def w4a_fp8_weight(
    rows: int,
    staged: Shaped[Tensor, "k n"],
    fragment: Shaped[Tensor, "rows n"] | None = None,
    decode_words: Shaped[Tensor, "rows n"] | None = None,
    words: Shaped[Tensor, "packed n"] | None = None,
) -> tuple[Tensor, str]:
    """``(weight, GEMM route)`` of an ``rows``-row W4A-FP8 kernel call: :func:`w4a_fp8_words`'
    pick among the packed forms held (``words`` None: none may be read), else the ``staged``
    E4M3 operand and :func:`w4a_fp8_gemm_route`'s GEMM.

    Example:
      >>> e4m3, w = torch.zeros(128, 32), torch.zeros(16, 32, dtype=torch.int32)
      >>> w4a_fp8_weight(1, e4m3, words=w)[0] is w, w4a_fp8_weight(1, e4m3)[0] is e4m3
      (True, True)
    """
    pick = None if words is None else w4a_fp8_words(rows, fragment, decode_words, words)
    return pick if pick is not None else (staged, w4a_fp8_gemm_route(rows, staged)[0])


def nvfp4_operand(
    rows: int, tuning: NVFP4Tuning = DEFAULT_NVFP4_TUNING, *, decode_words: bool = False
) -> Literal["decode_words", "words", "e4m3"]:
    """Which weight form an ``rows``-row W4A-NVFP4 emulation GEMM reads fastest: the int16
    decode words up to ``tuning.dwords_max_rows`` rows where the caller holds them
    (``decode_words``), the int32 words up to ``tuning.words_max_rows``, else the staged E4M3
    operand (same sums up to FP32 order).

    Example:
      >>> nvfp4_operand(1), nvfp4_operand(1, decode_words=True), nvfp4_operand(4096)
      ('words', 'decode_words', 'e4m3')
      >>> from floatxq.kernels.nvfp4 import NVFP4Tuning
      >>> nvfp4_operand(1, NVFP4Tuning(dwords_max_rows=0), decode_words=True)
      'words'
    """
    if decode_words and rows <= tuning.dwords_max_rows:
        return "decode_words"
    return "words" if rows <= tuning.words_max_rows else "e4m3"


def w4a_nvfp4_native_unavailable_reason(device: torch.device) -> str | None:
    """Why the native FP4 tensor-core route cannot run on ``device``'s tensors, or ``None``.

    It needs a torch with ``torch.float4_e2m1fn_x2``, ``F.scaled_mm``,
    ``F.ScalingType.BlockWise1x16`` and ``F.SwizzleType.SWIZZLE_32_4_4``, and a CUDA device of
    compute capability 12.1 or newer.

    Example:
      >>> w4a_nvfp4_native_unavailable_reason(torch.device("cpu")) is not None
      True
    """
    scaling = getattr(F, "ScalingType", None)
    swizzle = getattr(F, "SwizzleType", None)
    needs = (
        ("torch.float4_e2m1fn_x2", hasattr(torch, "float4_e2m1fn_x2")),
        ("F.scaled_mm", hasattr(F, "scaled_mm")),
        ("F.ScalingType.BlockWise1x16", hasattr(scaling, "BlockWise1x16")),
        ("F.SwizzleType.SWIZZLE_32_4_4", hasattr(swizzle, "SWIZZLE_32_4_4")),
    )
    missing = [name for name, present in needs if not present]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)}"
    if device.type != "cuda":
        return f"the tensors are on {device}; the FP4 tensor cores need a CUDA device"
    return capability_shortfall(
        device, _NATIVE_MIN_CAPABILITY, need="no FP4 tensor cores for F.scaled_mm's NVFP4 GEMM"
    )


def w4a_nvfp4_route(
    requested: str, device: torch.device, *, planes_staged: bool = True
) -> tuple[str, str | None]:
    """The W4A-NVFP4 route a call on ``device`` takes, and why the native route was not taken.

    Args:
      requested: ``"auto"``, ``"native"``, ``"emulation"`` or ``"reference"``.
      device: where the call's tensors are.
      planes_staged: whether the native weight operand is staged; ``"auto"`` passes over the
        native route without it.

    Returns:
      ``("native", None)`` where the FP4 tensor cores run; else ``("emulation", why)`` where the
      Triton emulation runs; else ``("reference", why)``. A forced route is taken or refused.

    Raises:
      ValueError: an unknown ``requested``.
      RuntimeError: ``"native"`` or ``"emulation"`` requested where it cannot run (the reason
        named), or ``"native"`` without the staged planes (call ``post_init()`` on the device).

    Example:
      >>> w4a_nvfp4_route("reference", torch.device("cpu"))
      ('reference', "route='reference' was requested")
    """
    where = "W4ANVFP4Linear"
    if requested not in W4A_NVFP4_ROUTES:
        raise ValueError(f"{where}: route must be one of {W4A_NVFP4_ROUTES}, got {requested!r}")
    if requested == "reference":
        return "reference", "route='reference' was requested"
    if requested == "emulation":
        why = _nvfp4_emulation_unavailable(device)
        if why is not None:
            raise RuntimeError(f"{where}: route='emulation' cannot run on {device}: {why}")
        return "emulation", "route='emulation' was requested"
    native = w4a_nvfp4_native_unavailable_reason(device)
    if requested == "native":
        if native is not None:
            raise RuntimeError(f"{where}: route='native' cannot run on {device}: {native}")
        if not planes_staged:
            raise RuntimeError(
                f"{where}: the native weight cache is absent; call post_init() (after moving "
                f"the module to {device})"
            )
        return "native", None
    if native is None and not planes_staged:
        native = "the FP4 weight planes are not staged (call post_init() on this device)"
    if native is None:
        return "native", None
    emulation = _nvfp4_emulation_unavailable(device)
    if emulation is None:
        return "emulation", f"native: {native}"
    return "reference", f"native: {native}; emulation: {emulation}"


def nvfp4_accumulator(device: torch.device) -> Callable[..., Tensor]:
    """The W4A-NVFP4 group-accumulation step: the Triton kernel where it runs on ``device``,
    else the pure :func:`floatxq.w4a_nvfp4_accumulate_group` (the same FP32 operations in the
    same order)."""
    try:
        from floatxq.kernels.nvfp4_decoding import nvfp4_accumulate_group
    except ImportError:  # pragma: no cover - the kernels ship with floatxq
        return w4a_nvfp4_accumulate_group
    if triton_unavailable_reason(device) is not None:
        return w4a_nvfp4_accumulate_group
    return nvfp4_accumulate_group


# ----------------------------------------------------------------------------------------------
# Packing activations, encoding FP8 weights
# ----------------------------------------------------------------------------------------------


def fp8_pack_reason(x2: Tensor) -> str | None:
    """Why the Triton ``fp8_pack`` is not taken for ``x2``, or None when it is."""
    if x2.dtype not in MODEL_DTYPES:
        return f"x is {x2.dtype}; the kernel reads float16, bfloat16 or float32"
    if x2.device.type != "cuda" and not triton_interpret_enabled():
        return f"x is on {x2.device}; the kernel runs on CUDA tensors (or TRITON_INTERPRET=1)"
    return _w4a_fp8_unavailable(x2.device)


def nvfp4_pack_reason(x2: Tensor) -> str | None:
    """Why the Triton ``nvfp4_pack_and_swizzle`` is not taken for ``x2``, or None when it is."""
    if x2.dtype not in MODEL_DTYPES:
        return f"x is {x2.dtype}; the kernel reads float16, bfloat16 or float32"
    if x2.device.type != "cuda":
        return f"x is on {x2.device}; the packer kernel runs on CUDA tensors"
    return _nvfp4_emulation_unavailable(x2.device)


def stream_pack_reason(device: torch.device, mode: W4AActivationMode) -> str | None:
    """Why an activation stream does not pack on ``device`` through the Triton packers with a
    device-side global scale (None: it does). CUDA only: elsewhere (``TRITON_INTERPRET=1``
    included) the stream packs through the checked :func:`pack_activation`."""
    if device.type != "cuda":
        return f"the tensors are on {device}"
    return (_w4a_fp8_unavailable if mode == "w4afp8" else _nvfp4_emulation_unavailable)(device)


def _pack_fp8(x2: Tensor) -> tuple[Tensor, Tensor]:
    if fp8_pack_reason(x2) is None:
        from floatxq.kernels.w4a_fp8 import fp8_pack

        return fp8_pack(x2)
    return _activation.pack_fp8_tokens(x2)


def _pack_nvfp4(x2: Tensor, x32: Tensor, g: Tensor, recipe: str) -> tuple[Tensor, Tensor]:
    if nvfp4_pack_reason(x2) is None:  # the Triton packer: the same bytes in one launch
        from floatxq.kernels.nvfp4 import nvfp4_pack_and_swizzle

        return nvfp4_pack_and_swizzle(x2, g, recipe=recipe)
    return _activation.pack_nvfp4_blocks(x2, x32, g, recipe)


def pack_activation(
    x: Float[Tensor, "*lead k"],
    mode: W4AActivationMode,
    *,
    global_scale: Float[Tensor, "*one"] | float | None = None,
    model_dtype: torch.dtype | None = None,
    recipe: NVFP4RecipeName | None = None,
    reference: Float[Tensor, "*lead k"] | None = None,
) -> W4AActivation:
    """:func:`floatxq.w4a.activation.pack_activation` through the Triton packers where they run.

    FP8 through ``fp8_pack`` on CUDA (or under ``TRITON_INTERPRET=1``); NVFP4 through
    ``nvfp4_pack_and_swizzle`` on CUDA; else the pure functions. Same arguments, checks and
    bytes as the pure function (the kernels' tests prove the bytes equal).

    Numerics: as :func:`floatxq.w4a.activation.pack_activation`.

    Example:
      >>> a = pack_activation(torch.full((1, 128), 3.0), "w4a_nvfp4", global_scale=1.0)
      >>> a.codes.shape, a.scales.shape, a.recipe
      (torch.Size([1, 64]), torch.Size([1, 1024]), 'least_squares')
    """
    return _activation.pack_activation_with(
        x, mode, global_scale=global_scale, model_dtype=model_dtype, recipe=recipe,
        reference=reference, fp8_packer=_pack_fp8,
        nvfp4_packer=_pack_nvfp4,
    )  # fmt: skip
