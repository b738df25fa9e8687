"""A quantized model and its lifecycle: :class:`QuantizedModel` quantizes a model's modules in
place, calibrates an activation stream and saves a checkpoint that :func:`floatxq.load`
(:mod:`floatxq.lifecycle.loading`) rebuilds bit for bit.
"""

import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import (
    BACKEND,
    FP8Config,
    GPTQConfig,
    NVFP4Config,
)
from floatxq.interop.checkpoint import (
    SIDE_FILES,
    TOKENIZER_FILES,
    TOKENIZER_LOADABLE_FILES,
    write_checkpoint,
)
from floatxq.interop.export import DEFAULT_LAYOUT, export_layout
from floatxq.lifecycle.distributed import check_process_group, check_split_rows
from floatxq.lifecycle.fp8 import quantize_fp8_modules
from floatxq.lifecycle.w4a_install import install_activation_stream, install_w4a_modules
from floatxq.nn.fp8_linear import TorchFP8Linear


def _quantized_types() -> tuple[type, ...]:
    """The module classes a quantized model holds; ``GPTQLinear`` last."""
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.nn.gptq_linear import GPTQLinear

    return (TorchFP8Linear, TorchFP4Linear, GPTQLinear)


class InterruptedQuantize(NamedTuple):
    """What a GPTQ :meth:`QuantizedModel.quantize` that raised part-way left in the model."""

    done: tuple[str, ...]
    """The modules already replaced by their quantized modules, in solve order."""
    total: int
    """The modules the run was to quantize."""
    error: str
    """The exception that stopped it (``"KeyboardInterrupt"``, ``"ValueError: ..."``)."""
    config: Any
    """The ``GPTQConfig`` it ran with (a resumed run must use the same)."""
    reports: tuple[Any, ...]
    """The :class:`~floatxq.lifecycle.gptq.GPTQModuleReport` of each module in ``done``."""

    def describe(self) -> str:
        return (
            f"an earlier quantize() was interrupted ({self.error}) after replacing "
            f"{len(self.done)} of {self.total} modules, so the model is partly quantized"
        )


class QuantizedModel:
    """A model plus the quantization that was or will be applied to it.

    ``quantize()`` replaces modules in place (one at a time), ``save(path)`` writes a checkpoint
    that ``floatxq.load(path)`` rebuilds bit for bit, and ``model`` is the ``nn.Module`` to run.

    Numerics: FP8 weight-only as :func:`floatxq.quantize_fp8_weight`.
    """

    def __init__(
        self,
        model: Any,  # an nn.Module; an mlx_lm model for backend "mlx"
        *,
        quantize_config: FP8Config | GPTQConfig | NVFP4Config | None,
        backend: BACKEND,
        quantized: bool = False,
        source: Path | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.quantize_config = quantize_config
        self.backend = backend
        self.quantized = quantized
        self.quantized_modules: list[str] = (
            [n for n, m in model.named_modules() if isinstance(m, _quantized_types())]
            if quantized
            else []
        )
        self.layout: Any = None
        """The :class:`~floatxq.interop.layouts.LayoutDecision` a checkpoint was read with."""
        self.source = source
        self.device = device
        self.quantize_seconds: float | None = None
        self.report: Any = None
        """The last :meth:`quantize` run's :class:`~floatxq.lifecycle.gptq.GPTQRunReport` (GPTQ)."""
        self.tokenizer: Any = None
        """Turns calibration strings into ids (set it, or pass ``quantize(tokenizer=...)``);
        when None, the source directory's tokenizer is loaded the first time a string sample
        needs it (the byte tokenizer for the built-in tiny Llama)."""
        self.interrupted: InterruptedQuantize | None = None
        """Set when a GPTQ :meth:`quantize` raised after replacing modules (the model is then
        partly quantized, and ``quantize()`` and ``save()`` refuse it); None otherwise."""
        self.save_layout: str | None = None
        """The layout given to ``quantize(layout=...)``: checked before the work, and the layout
        ``save()`` writes when given none."""
        self.offload: Any = None
        """``load(..., offload="disk")``: the :class:`~floatxq.lifecycle.offload.OffloadSource`
        the decoder layers are read from; ``quantize(out=...)`` writes the checkpoint."""

    def check_save_layout(self, layout: str | None = None) -> str:
        """Refuse, before any work, a save ``layout`` that cannot hold this model once quantized
        with its ``quantize_config`` (:func:`~floatxq.lifecycle.layout_check.check_layout`);
        returns the canonical layout name."""
        from floatxq.lifecycle.layout_check import check_layout

        return check_layout(self, None, layout or self.save_layout, where="layout")

    @property
    def partially_quantized(self) -> bool:
        """True after a GPTQ :meth:`quantize` was interrupted part-way (see ``interrupted``)."""
        return self.interrupted is not None

    def __repr__(self) -> str:
        kind = {GPTQConfig: "GPTQ", NVFP4Config: "NVFP4"}.get(type(self.quantize_config), "FP8")
        state = (
            f"{len(self.quantized_modules)} {kind} modules" if self.quantized else "not quantized"
        )
        if self.interrupted is not None:
            done, total = len(self.interrupted.done), self.interrupted.total
            state = f"interrupted after {done} of {total} GPTQ modules"
        return f"QuantizedModel({type(self.model).__name__}, {state}, backend={self.backend.value})"

    mlx_routes: dict[str, str] | None = None
    """``backend="mlx"``: each linear's MLX route (``dense``, ``mxfp8`` or ``packed``)."""

    def quantize(
        self,
        calibration: Iterable[Any] | None = None,
        *,
        batch_size: int = 1,
        progress: bool | Callable[[str], None] = True,
        tokenizer: Any = None,
        resume: bool = False,
        layout: str | None = None,
        max_length: int | None = None,
        overflow: str = "refuse",
        num_samples: int | None = None,
        text_column: str = "text",
        out: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
        max_shard_size: int | str = "4GB",
        activation_budget: int | str | None = None,
        process_group: Any = None,
        split_rows: bool = False,
    ) -> "QuantizedModel":
        """Quantize the model's linear modules in place.

        FP8 and NVFP4 round to nearest are weight-only (no calibration). GPTQ, and NVFP4 with
        ``method="gptq"`` or ``activations="nvfp4"``, are calibrated and run layer by layer
        (:mod:`floatxq.lifecycle.gptq`, :mod:`floatxq.lifecycle.nvfp4_calibrated`): a decoder
        layer at a time on the work device (``device`` of :func:`load`, else CUDA, else CPU);
        the model ends on ``device`` if given.

        Args:
          calibration: GPTQ's samples: strings, 1-D token-id tensors, lists of ints or mappings
            with ``input_ids`` (:func:`~floatxq.lifecycle.calibration.prepare_calibration`);
            samples of at most 10 tokens are dropped with a warning. FP8 ignores it (warning).
          batch_size: GPTQ samples per forward (right-padded; padding is masked out).
          progress: show progress bars (True), stay quiet (False), or a callback per module.
          tokenizer: GPTQ: turns string samples into ids (default: the source's tokenizer).
          resume: GPTQ: finish an interrupted run (below) with the same calibration.
          layout: the checkpoint layout the model will be saved in: checked against the config
            and the model's modules before any work (:meth:`check_save_layout`), and the layout
            ``save()`` writes when given none. None checks nothing.
          max_length: GPTQ: the longest calibration sample, at most the model's
            ``max_position_embeddings`` (the default).
          overflow: GPTQ: a sample longer than that is refused (``"refuse"``, the default),
            cut (``"truncate"``), or all samples are concatenated and cut into windows of
            ``max_length`` tokens (``"chunk"``).
          num_samples: GPTQ: use at most this many samples (windows with ``"chunk"``).
          text_column: GPTQ: the column of a ``datasets`` Dataset (or the key of mapping
            samples) that holds the text.
          out, overwrite, max_shard_size: ``offload="disk"`` only: the checkpoint written as
            layers finish (``docs/offload.md``), as :meth:`save` takes them; ``resume=True``
            finishes a run cut short.
          activation_budget: calibrated methods: the bytes (or ``"8GB"``) of the work device the
            calibration activations may take; beyond it they live in host memory, a batch copied
            over at a time, with the same results. None: no limit.
          process_group: a ``torch.distributed`` group (one process per GPU, as ``torchrun``
            starts them: :func:`~floatxq.lifecycle.distributed.torchrun_setup`) sharing the work:
            calibration batches dealt out, statistics folded in one process's order, module
            solves spread; every process ends with the model one process alone gives
            (``docs/distributed.md``). ``split_rows``: GPTQ splits every module's rows over it.

        Raises:
          RuntimeError: no quantize_config, or the model is already quantized.
          ValueError: GPTQ without calibration or with unusable calibration (empty, too short,
            strings without a tokenizer, ids outside the vocabulary, non-finite activations), a
            module the settings cannot pack (:func:`~floatxq.lifecycle.gptq.plan_gptq`); an
            interrupted model without ``resume=True``, or a ``resume`` that cannot resume; a
            ``layout`` that cannot hold a module the config quantizes (before any work).
          TypeError: ``resume`` is not a bool.

        On failure FP8 rolls back (every replaced module put back). GPTQ, which releases each
        original once solved, sets ``interrupted`` (an :class:`InterruptedQuantize`) instead;
        ``quantize()`` and ``save()`` then refuse the model until it is reloaded or resumed with
        ``resume=True`` (``docs/gptq.md``, "An interrupted run").

        Numerics: FP8 as :func:`floatxq.quantize_fp8_weight`; NVFP4 as
        :func:`floatxq.lifecycle.nvfp4.quantize_nvfp4_modules`; GPTQ as :func:`floatxq.gptq_solve`.
        """
        if self.quantize_config is None:
            raise RuntimeError("quantize: no quantize_config was given to floatxq.load")
        if self.quantized:
            raise RuntimeError("quantize: this model is already quantized")
        if not isinstance(resume, bool):
            raise TypeError(f"quantize: resume must be a bool, got {type(resume).__name__}")
        options = {
            "max_length": max_length,
            "overflow": overflow,
            "num_samples": num_samples,
            "text_column": text_column,
            "activation_budget": _parse_budget(activation_budget),
            "process_group": check_process_group(process_group, where="quantize"),
        }
        gptq = isinstance(self.quantize_config, GPTQConfig)
        options["split_rows"] = check_split_rows(split_rows, process_group, gptq, where="quantize")
        if process_group is not None and progress is True:  # one bar: the first process's
            progress = torch.distributed.get_rank(process_group) == 0
        if self.offload is not None or out is not None:
            prepared = None
            if calibration is not None and self._calibrated():
                prepared = self._prepared(calibration, batch_size, tokenizer, options)
            return self._quantize_offloaded(
                out, layout, resume, overwrite, max_shard_size, progress, prepared,
                options,
            )  # fmt: skip
        self._check_resume(resume)
        if layout is not None:
            from floatxq.lifecycle.layout_check import check_layout

            self.save_layout = check_layout(self, None, layout, where="quantize")
        if isinstance(self.quantize_config, GPTQConfig):
            return self._quantize_gptq(calibration, batch_size, progress, tokenizer, options)
        nvfp4 = isinstance(self.quantize_config, NVFP4Config)
        if self.quantize_config.needs_calibration:
            return self._quantize_calibrated(calibration, batch_size, progress, tokenizer, options)
        kind = "NVFP4" if nvfp4 else "FP8"
        if calibration is not None:
            warnings.warn(
                f"quantize: {kind} weight-only quantization needs no calibration data; the "
                f"given dataset is ignored",
                UserWarning,
                stacklevel=2,
            )
        from floatxq.lifecycle.fp8 import plan_fp8
        from floatxq.lifecycle.nvfp4 import plan_nvfp4, quantize_nvfp4_modules

        plan = plan_nvfp4 if nvfp4 else plan_fp8
        swap = quantize_nvfp4_modules if nvfp4 else quantize_fp8_modules
        total = sum(p.config is not None for p in plan(self.model, self.quantize_config))
        callback, bar = _progress(progress, total, f"{kind.lower()} quantize")
        start = time.perf_counter()
        # NVFP4 and GSQ compute on the work device (CUDA when there is one), each module going back
        extra: dict[str, Any] = {"work_device": self.device or _default_work_device(self.model)}
        if options["process_group"] is not None:
            extra["process_group"] = options["process_group"]
        gsq_reports: list[Any] = []
        if not nvfp4:
            extra["reports"] = gsq_reports
        try:
            self.quantized_modules = swap(
                self.model, self.quantize_config, device=self.device, on_module=callback, **extra
            )
        finally:
            if bar is not None:
                bar.close()
        self.quantize_seconds = time.perf_counter() - start
        if getattr(self.quantize_config, "gsq", None) is not None:
            from floatxq.lifecycle.fp8_gsq import FP8RunReport

            self.report = FP8RunReport(tuple(gsq_reports), 0, 0, 0, self.quantize_seconds)
        self.quantized = True
        return self

    def _calibrated(self) -> bool:
        """The method needs calibration data (GPTQ, NVFP4 GPTQ / W4A4, calibrated GSQ)."""
        config = self.quantize_config
        return isinstance(config, GPTQConfig) or bool(getattr(config, "needs_calibration", False))

    def _quantize_offloaded(
        self, out: Any, layout: Any, resume: bool, overwrite: bool, size: Any, progress: Any,
        calibration: Any, options: Mapping[str, Any],
    ) -> "QuantizedModel":  # fmt: skip
        """``offload="disk"``: layer by layer from the shards, written to ``out`` as it goes
        (:func:`~floatxq.lifecycle.offload.quantize_offloaded`)."""
        from floatxq.lifecycle.offload import quantize_offloaded

        if self.offload is None:
            raise ValueError(
                "quantize: out= is for models loaded with offload='disk' (written as layers "
                "finish); call save(path) after quantize()"
            )
        if out is None:
            raise ValueError(
                "quantize: a model loaded with offload='disk' is written as its layers finish; "
                "pass out=DIRECTORY"
            )
        from floatxq.lifecycle.decoder import decoder_layers

        layers = len(decoder_layers(self.model)[1])
        callback, bar = _progress(progress, layers, "offloaded layers")
        try:
            report = quantize_offloaded(
                self, out=out, layout=layout, resume=resume, overwrite=overwrite,
                max_shard_bytes=_parse_size(size),
                work_device=self.device or _default_work_device(self.model),
                calibration=calibration, activation_budget=options["activation_budget"],
                process_group=options["process_group"], split_rows=options["split_rows"],
                on_layer=None if callback is None else lambda i, n: callback(f"layer {i}"),
            )  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
        if bar is not None:  # the bar's closing line: time and peak memory
            bar.write(report.describe())
        self.report = report
        self.quantize_seconds = report.seconds
        self.quantized = True
        self.quantized_modules = list(report.names)
        return self

    def _check_resume(self, resume: bool) -> None:
        """Refuse a model left partly quantized by an interrupted GPTQ run, unless ``resume``
        and the run can be resumed; refuse ``resume`` with nothing to resume."""
        previous = self.interrupted
        if previous is None:
            if resume:
                raise ValueError(
                    "quantize: resume=True, but no earlier quantize() of this model was "
                    "interrupted; call quantize() without resume"
                )
            return
        reload = "reload the model with floatxq.load(...) and quantize it again"
        if getattr(previous.config, "activation", None) is not None:
            raise ValueError(
                f"quantize: {previous.describe()}; a run with an activation policy cannot be "
                f"resumed (its replay solves whole layers), so {reload}"
            )
        if not resume:
            raise ValueError(
                f"quantize: {previous.describe()}; {reload}, or call quantize(calibration, "
                f"resume=True) with the same calibration to solve the remaining "
                f"{previous.total - len(previous.done)} modules"
            )
        if self.quantize_config != previous.config:
            raise ValueError(
                f"quantize: resume=True, but quantize_config changed since the interrupted run "
                f"({previous.config} then, {self.quantize_config} now); resuming would mix "
                f"settings, so {reload}"
            )

    def _prepared(
        self, calibration: Any, batch_size: int, tokenizer: Any, options: Mapping[str, Any]
    ) -> Any:
        """The calibration batches (:func:`~floatxq.lifecycle.calibration.prepare_calibration`)
        with the model's padding id, vocabulary and positions."""
        from floatxq.lifecycle.calibration import prepare_calibration

        hf_config = getattr(self.model, "config", None)
        pad = getattr(hf_config, "pad_token_id", None)
        return prepare_calibration(
            calibration,
            tokenizer=tokenizer or self.tokenizer or _LazyTokenizer(self.source),
            batch_size=batch_size,
            pad_token_id=pad if isinstance(pad, int) else 0,
            vocab_size=getattr(hf_config, "vocab_size", None),
            max_length=_max_length(options["max_length"], hf_config),
            overflow=options["overflow"],
            num_samples=options["num_samples"],
            text_column=options["text_column"],
        )

    def _quantize_calibrated(
        self,
        calibration: Any,
        batch_size: int,
        progress: Any,
        tokenizer: Any,
        options: Mapping[str, Any],
    ) -> "QuantizedModel":
        """NVFP4 with ``method="gptq"`` or W4A4, FP8 with calibrated GSQ: layer by layer; rolls
        back on failure (:func:`~floatxq.lifecycle.layerwise.quantize_layerwise`)."""
        from floatxq.lifecycle.fp8 import plan_fp8
        from floatxq.lifecycle.fp8_gsq import quantize_fp8_calibrated
        from floatxq.lifecycle.nvfp4 import plan_nvfp4
        from floatxq.lifecycle.nvfp4_calibrated import quantize_nvfp4_calibrated

        config = self.quantize_config
        nvfp4 = isinstance(config, NVFP4Config)
        if calibration is None:
            what = (
                "NVFP4 with method='gptq' or activations='nvfp4'"
                if nvfp4
                else "FP8 with gsq_calibration=True"
            )
            raise ValueError(
                f"quantize: {what} needs calibration data (strings or token-id tensors); "
                f"floatxq.tiny.calibration_samples(...) gives some for the built-in tiny Llama"
            )
        plan = plan_nvfp4 if nvfp4 else plan_fp8
        run = quantize_nvfp4_calibrated if nvfp4 else quantize_fp8_calibrated
        planned = [p.name for p in plan(self.model, config) if p.config is not None]  # type: ignore[arg-type]
        total = len(planned)
        prepared = self._prepared(calibration, batch_size, tokenizer, options)
        work = self.device or _default_work_device(self.model)
        callback, bar = _progress(progress, total, "nvfp4 quantize" if nvfp4 else "fp8 gsq")
        start = time.perf_counter()
        try:
            report = run(
                self.model, config, prepared, device=work, on_module=callback,  # type: ignore[arg-type]
                activation_budget=options["activation_budget"],
                process_group=options["process_group"],
            )  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
        if self.device is not None:
            self.model.to(self.device)
        self.report = report
        self.quantize_seconds = time.perf_counter() - start
        self.quantized = True
        self.quantized_modules = planned  # every FP8/NVFP4 module, refined by GSQ or not
        return self

    def _quantize_gptq(
        self,
        calibration: Any,
        batch_size: int,
        progress: Any,
        tokenizer: Any,
        options: Mapping[str, Any],
    ) -> "QuantizedModel":
        from floatxq.lifecycle.gptq import plan_gptq, quantize_gptq_model

        config = self.quantize_config
        assert isinstance(config, GPTQConfig)
        if calibration is None:
            raise ValueError(
                "quantize: GPTQ needs calibration data (strings or token-id tensors); "
                "floatxq.tiny.calibration_samples(...) gives some for the built-in tiny Llama"
            )
        previous = self.interrupted  # set only when resuming (quantize checked it)
        finished = previous is not None and len(previous.done) == previous.total
        # refuses unpackable modules before any work (a finished resume has none left)
        plans = [] if finished else plan_gptq(self.model, config)
        prepared = self._prepared(calibration, batch_size, tokenizer, options)
        work = self.device or _default_work_device(self.model)
        names = [p.name for p in plans if p.config is not None]
        kinds = {name: type(self.model.get_submodule(name)) for name in names}
        earlier = () if previous is None else previous.reports
        reports: list[Any] = []  # the modules this call solves, appended as each is solved
        callback, bar = _progress(progress, len(names), "gptq")
        start = time.perf_counter()
        try:
            try:
                if finished:  # an earlier run solved every module and failed after them
                    report = _finished_report(self.model, earlier, prepared)
                else:
                    report = quantize_gptq_model(
                        self.model, config, prepared, device=work, on_module=callback,
                        reports=reports, activation_budget=options["activation_budget"],
                        process_group=options["process_group"], split_rows=options["split_rows"],
                    )  # fmt: skip
                    report = report._replace(modules=(*earlier, *report.modules))
            finally:
                if bar is not None:
                    bar.close()
            if self.device is not None:
                self.model.to(self.device)
            if config.activation is not None:  # W4A: the solved modules run the policy's GEMMs
                scales = getattr(report, "activation_scales", None) or {}
                install_w4a_modules(
                    self.model, self.backend, activation=config.activation, scales=scales
                )
                install_activation_stream(self.model, config.activation)
        except BaseException as exc:  # KeyboardInterrupt too: mark what was replaced, re-raise
            done = [n for n in names if type(self.model.get_submodule(n)) is not kinds[n]]
            if done or previous is not None:
                self.interrupted = InterruptedQuantize(
                    done=(*(() if previous is None else previous.done), *done),
                    total=len(names) if previous is None else previous.total,
                    error=_describe(exc),
                    config=config,
                    reports=(*earlier, *reports),
                )
            raise
        self.report = report
        self.interrupted = None
        self.quantize_seconds = time.perf_counter() - start
        self.quantized = True
        self.quantized_modules = [m.name for m in report.modules]
        return self

    def calibrate_activations(
        self,
        samples: Sequence[torch.Tensor],
        *,
        progress: Callable[[str, Mapping[str, Any]], None] | bool | None = None,
    ) -> dict[str, Any]:
        """Calibrate the installed NVFP4 stream's producer global scales on ``samples``.

        Activations only: the weights are not touched. Each producer boundary (reference:
        :mod:`floatxq.lifecycle.activation_calibration`) gets the FP32 scale that maps the
        largest magnitude it sees onto E2M1 value 6 (``nvidia``) or 4 (other recipes) at block
        scale 448; the scales go into the stream, ``quantize_config.activation.global_scales``
        and the saved files. On any failure everything is restored and the error re-raised.

        Args:
          samples: a non-empty list of unpadded 1-D token-id tensors.
          progress: ``None``/``False`` (quiet), ``True`` (a progress bar), or a callable given
            ``(producer_key, row)`` as each producer is done.

        Returns:
          The report: ``algorithm`` (``"producer_maximum"``), ``recipe``, ``global_scales``,
          ``boundaries`` (per key: ``recipe``, ``amax``, ``global_scale``, ``tokens``,
          ``samples``), ``upstream_activations``, ``weight_updates`` (0).

        Raises:
          RuntimeError / ValueError / TypeError: as
          :func:`~floatxq.lifecycle.activation_calibration.calibrate_nvfp4_producers`;
          ValueError for a model an interrupted GPTQ run left partly quantized.

        Numerics: ``scale = max|x| / (448·6)`` for ``nvidia``, ``/ (448·4)`` otherwise (FP32).
        """
        from floatxq.lifecycle.activation_calibration import calibrate_nvfp4_producers
        from floatxq.lifecycle.stream import stream_boundary_quantizers

        if self.interrupted is not None:
            raise ValueError(
                f"calibrate_activations: {self.interrupted.describe()}; reload the model with "
                f"floatxq.load(...) and quantize it again"
            )

        if progress is True:
            total = len(stream_boundary_quantizers(self.model))
            step, bar = _progress(True, total, "calibrate activations")
            try:
                shown = None if step is None else (lambda key, _row: step(key))
                return calibrate_nvfp4_producers(self, samples, progress=shown)
            finally:
                if bar is not None:
                    bar.close()
        if progress is False:
            progress = None
        if progress is not None and not callable(progress):
            raise TypeError(
                f"calibrate_activations: progress must be None, a bool or a callable, got "
                f"{type(progress).__name__}"
            )
        return calibrate_nvfp4_producers(self, samples, progress=progress)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        layout: str | None = None,
        max_shard_size: int | str = "4GB",
        overwrite: bool = False,
    ) -> Path:
        """Write the model in a checkpoint ``layout`` atomically (temporary directory, rename).

        Args:
          path: the directory to create.
          layout: None (the layout given to ``quantize(layout=...)``, else ``"gptq"`` for a
            model with a W4A activation policy, else
            ``"compressed-tensors"``), ``"compressed-tensors"``, ``"hf"``, ``"gptqmodel"``,
            ``"gptq"`` or ``"modelopt"`` (NVFP4 models); ``docs/interop.md`` has the table of what
            each writes and who reads it.
          max_shard_size: bytes per safetensors shard (an int or like ``"4GB"``).
          overwrite: replace an existing directory (only once the new one is complete).

        Raises:
          RuntimeError: the model is not quantized. FileExistsError: ``path`` exists (or is a
            file). ValueError: a model an interrupted GPTQ run left partly quantized (see
            :meth:`quantize`), a layout that cannot hold the model's modules (named), an unknown
            layout, a bad ``max_shard_size``, or a target that is the working directory, the
            home directory, a filesystem root, one of their parents, a file or a symlink.
          OSError: the directory cannot be written (named); nothing is left behind, and an
            interrupted replacement is restored by the next save or load.

        Numerics: FP8 codes, NVFP4 bytes and GPTQ words are written as they are (GPTQ zero
        words converted exactly between v1 and v2 where the layout or config needs the other).
        Layouts whose scales multiply store the FP32 reciprocal of floatxq's inverse FP8 scales
        (exact for powers of two, else within half an FP32 ulp); ``gptqmodel`` stores them
        unchanged.
        """
        if self.backend == BACKEND.MLX:
            raise RuntimeError(
                "save: this is an MLX model converted from a checkpoint; save the checkpoint "
                "from its torch model (floatxq.load(path) without backend='mlx')"
            )
        if self.interrupted is not None:
            resume = (
                ""
                if getattr(self.interrupted.config, "activation", None) is not None
                else ", or finish it with quantize(calibration, resume=True)"
            )
            raise ValueError(
                f"save: {self.interrupted.describe()} and is not saved; reload it with "
                f"floatxq.load(...) and quantize it again{resume}"
            )
        if not self.quantized:
            raise RuntimeError("save: quantize() the model first (or load a quantized checkpoint)")
        config_obj = getattr(self.model, "config", None)
        if config_obj is None or not hasattr(config_obj, "to_dict"):
            raise TypeError("save: the model has no Hugging Face config to write as config.json")
        if layout is None:
            layout = self.save_layout
        if layout is None:
            activation = getattr(self.quantize_config, "activation", None)
            layout = DEFAULT_LAYOUT if activation is None else "gptq"
        exported = export_layout(self.model, self.quantize_config, layout)
        config = config_obj.to_dict()
        config["quantization_config"] = exported.quantization_config
        extra = {}
        if self.source is not None:
            extra = {n: self.source / n for n in SIDE_FILES if (self.source / n).is_file()}
        return write_checkpoint(
            path,
            exported.state,
            config=config,
            quantize_config=exported.quantize_config,
            extra_files=extra,
            max_shard_bytes=_parse_size(max_shard_size),
            overwrite=overwrite,
            json_files=exported.json_files,
        )


def _max_length(asked: Any, hf_config: Any) -> Any:
    """``quantize(max_length=...)``: the model's ``max_position_embeddings`` when not given; a
    longer one is refused (the model has no positions for it)."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    if asked is None or not isinstance(positions, int) or isinstance(asked, bool):
        return positions if asked is None else asked
    if isinstance(asked, int) and asked > positions:
        raise ValueError(
            f"quantize: max_length={asked} is more than the model's {positions} positions "
            f"(max_position_embeddings); pick at most {positions}"
        )
    return asked


def _describe(exc: BaseException) -> str:
    """``"KeyboardInterrupt"`` or ``"ValueError: <first 200 characters of its message>"``."""
    message = " ".join(str(exc).split())
    if len(message) > 200:
        message = message[:197] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _finished_report(model: nn.Module, modules: tuple[Any, ...], calibration: Any) -> Any:
    """The report of a resumed run whose interrupted run had solved every module."""
    from floatxq.lifecycle.gptq import GPTQRunReport, decoder_layers

    layers = len(decoder_layers(model)[1])
    samples, dropped, tokens = calibration.samples, calibration.dropped, calibration.tokens
    return GPTQRunReport(tuple(modules), layers, samples, dropped, tokens, 0.0)


def _parse_budget(value: object) -> int | None:
    """``quantize(activation_budget=...)``: None, 0 (every activation in host memory), or a
    size as :func:`_parse_size` reads it."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return None if value is None else 0
    try:
        return _parse_size(value)
    except ValueError as exc:
        raise ValueError(f"quantize: activation_budget: {exc}") from None


def _parse_size(value: object) -> int:
    """``max_shard_size`` in bytes: a positive int, or a size string as ``transformers``'
    ``save_pretrained`` reads it (``huggingface_hub``'s ``parse_size_to_int``: KB, MB, GB, TB of
    1000, any case, so ``"4GB"`` is 4·10⁹ bytes), or in KiB, MiB, GiB, TiB of 1024 (``"4GiB"`` is
    4·2³⁰ bytes; Hugging Face's parser has no binary units); rounded down to whole bytes.

    Takes any object because it is the check: bools, floats, zero, negatives, NaN/inf and unknown
    units are refused with ValueError, other kinds with TypeError.
    """
    from huggingface_hub.serialization._base import parse_size_to_int

    accepted = "a positive int of bytes or a size like '4GB' (4·10^9 bytes), '500MB' or '4GiB'"
    if isinstance(value, (bool, float)):
        raise ValueError(f"save: max_shard_size must be {accepted}, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"save: max_shard_size must be {accepted}, got {value!r}")
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"save: max_shard_size must be {accepted}, got {type(value).__name__} {value!r}"
        )
    text = value.strip()
    binary = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}.get(text[-3:].upper())
    try:  # float() takes "nan" and "inf": int() refuses them below
        size = int(float(text[:-3]) * binary) if binary else parse_size_to_int(text)
    except (ValueError, OverflowError):
        size = 0
    if size < 1:
        raise ValueError(f"save: max_shard_size must be {accepted}, got {value!r}")
    return size


def _progress(progress: Any, total: int, desc: str):
    """``(callback per module name, bar to close)`` for ``quantize(progress=...)``: the user's
    callable as is, nothing for False, else a tqdm bar over ``total`` modules."""
    if callable(progress) and not isinstance(progress, bool):
        return progress, None
    if not progress:
        return None, None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return None, None
    bar = tqdm(total=total, desc=desc, unit="module", leave=False)

    def step(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    return step, bar


def _default_work_device(model: nn.Module) -> torch.device:
    """Where GPTQ works when ``load`` was given no device: the model's CUDA device if it is
    on one, else the current CUDA device when there is one, else the CPU."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        return first.device
    if torch.cuda.is_available():  # the current one: torch.cuda.set_device picks it per process
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _LazyTokenizer:
    """The source directory's tokenizer, loaded on the first string it is asked to encode (the
    byte tokenizer for the built-in tiny Llama); a clear error when there is none."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.tokenizer: Any = None

    def __call__(self, text: str) -> Any:
        if self.tokenizer is None:
            self.tokenizer = self._load()
        return self.tokenizer(text)

    def _load(self) -> Any:
        from floatxq.tiny import TINY_LLAMA_DIR, encode_text

        where = "calibration"
        if self.path is None:
            raise ValueError(
                f"{where}: string samples need a tokenizer, and this model was given as a module; "
                f"pass token-id tensors or quantize(..., tokenizer=...)"
            )
        if self.path.resolve() == TINY_LLAMA_DIR.resolve():
            return encode_text
        if not any((self.path / n).is_file() for n in TOKENIZER_LOADABLE_FILES):
            present = [n for n in TOKENIZER_FILES if (self.path / n).is_file()]
            only = f" (only {', '.join(present)}, which hold no vocabulary)" if present else ""
            raise ValueError(
                f"{where}: no tokenizer files in {self.path}{only}; string samples need a "
                f"tokenizer: pass tokenizer= (quantize(..., tokenizer=...) or "
                f"QuantizedModel.tokenizer), or token-id tensors; looked for "
                f"{', '.join(TOKENIZER_LOADABLE_FILES)}"
            )
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:  # transformers raises many kinds for damaged tokenizer files
            raise ValueError(
                f"{where}: the tokenizer in {self.path} could not be loaded "
                f"({type(exc).__name__}: {exc}); pass token-id tensors or a tokenizer"
            ) from exc


__all__ = ["InterruptedQuantize", "QuantizedModel"]
