"""The GSQ part of ``floatxq quantize``: its options as a ``GSQConfig``, and what the command
prints about a GSQ run (a summary line, a line per module, the entries of its ``--json`` object).

The report is read as an :class:`~floatxq.lifecycle.fp8_gsq.FP8RunReport`, by its fields only
(``modules``, ``layers``, ``samples``, ``tokens``, ``seconds``; each module a
:class:`~floatxq.lifecycle.fp8.GSQModuleReport`), so formatting it imports nothing.
"""

import math
from typing import Any

__all__ = ["gsq_config", "gsq_module_line", "gsq_report_dict", "gsq_summary"]

OPTIONS: dict[str, str] = {
    "steps": "--gsq-steps",
    "candidates": "--gsq-candidates",
    "seed": "--gsq-seed",
}
"""The command line's GSQ settings: ``GSQConfig`` field -> option."""


def gsq_config(method: str, on: bool, calibrated: bool, settings: dict[str, Any]) -> Any:
    """``--gsq`` and its settings as a ``GSQConfig`` (None without ``--gsq``): FP8 only, each
    setting needs ``--gsq``, and a setting's error names its option.

    Raises:
      ValueError: naming the option (``--gsq-steps: steps: got 0, accepted: 1 <= steps``).
    """
    given = [OPTIONS[k] for k, v in settings.items() if v is not None]
    given += ["--gsq-calibration"] if calibrated else []
    if method != "fp8" and (on or given):
        raise ValueError(
            f"{'--gsq' if on else given[0]} refines FP8 codes: it applies to --method fp8 only"
        )
    if not on:
        if given:
            raise ValueError(f"{given[0]} needs --gsq")
        return None
    from floatxq.config import GSQConfig

    try:
        return GSQConfig(**{k: v for k, v in settings.items() if v is not None})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{OPTIONS.get(str(exc).split(':')[0], '--gsq')}: {exc}") from None


def _ratio(after: float, before: float) -> float:
    """``after / before``; 1.0 when both are 0 (a module already exact stays exact)."""
    if before == 0.0:
        return 1.0 if after == 0.0 else math.inf
    return after / before


def _mean_ratio(report: Any) -> float | None:
    """The mean over the refined modules of objective after / before; None without modules."""
    ratios = [_ratio(m.objective_after, m.objective_before) for m in report.modules]
    return sum(ratios) / len(ratios) if ratios else None


def gsq_summary(report: Any) -> str:
    """One line: modules refined, codes changed of all, the mean objective ratio, the seconds.

    Example:
      ``gsq: 14 modules refined (weight-only), 120 of 229376 codes changed (0.052%), mean
      objective after/before 0.9981, 1.9 s``
    """
    modules = report.modules
    changed = sum(m.changed for m in modules)
    codes = sum(m.codes for m in modules)
    share = 100.0 * changed / codes if codes else 0.0
    how = "calibrated" if any(m.calibrated for m in modules) else "weight-only"
    if report.samples:
        how += f" on {report.samples} samples, {report.tokens} tokens"
    ratio = _mean_ratio(report)
    objective = (
        "no module selected" if ratio is None else f"mean objective after/before {ratio:.4f}"
    )
    return (
        f"gsq: {len(modules)} modules refined ({how}), {changed} of {codes} codes changed "
        f"({share:.3g}%), {objective}, {report.seconds:.1f} s"
    )


def gsq_module_line(module: Any) -> str:
    """One module's refinement: its objective before and after, codes changed, seconds."""
    return (
        f"  {module.name}: objective {module.objective_before:.4e} -> "
        f"{module.objective_after:.4e}, {module.changed} of {module.codes} codes changed, "
        f"{module.seconds:.2f} s"
    )


def gsq_report_dict(report: Any) -> dict[str, Any]:
    """``quantize --json``'s ``gsq`` entry: the run's totals and every module's report."""
    modules = [dict(m._asdict()) for m in report.modules]
    return {
        "modules_refined": len(modules),
        "changed": sum(m["changed"] for m in modules),
        "codes": sum(m["codes"] for m in modules),
        "mean_objective_ratio": _mean_ratio(report),
        "layers": report.layers,
        "samples": report.samples,
        "tokens": report.tokens,
        "seconds": report.seconds,
        "modules": modules,
    }
