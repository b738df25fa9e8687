"""The GSQ refinement settings: :class:`GSQConfig`, carried by :class:`~floatxq.config.FP8Config`.

GSQ (Gumbel-softmax quantization) re-chooses FP8 weight codes after round to nearest: each code
may move to a neighbouring finite code of the storage grid, inverse scales frozen, when that
lowers a reconstruction objective. The math is :func:`floatxq.refine_fp8_codes`; this record
only names its settings.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

from floatxq.config.rules import RulePattern, _check_rule_pattern
from floatxq.config.values import _check_bool, _check_int, _check_real

__all__ = ["GSQConfig"]

GSQ_MAX_CANDIDATES = 33
"""The most candidate codes per weight (the baseline and 16 neighbours each side)."""


def _positive_int(value: Any, *, where: str, low: int = 1, high: int | None = None) -> int:
    number = _check_int(value, where=where)
    if number < low or (high is not None and number > high):
        bound = f"{low} <= {where}" + (f" <= {high}" if high is not None else "")
        raise ValueError(f"{where}: got {number!r}, accepted: {bound}")
    return number


def _positive_real(value: Any, *, where: str) -> float:
    number = _check_real(value, where=where)
    if number <= 0.0:
        raise ValueError(f"{where}: got {number!r}, accepted: a finite number > 0")
    return number


def _module_patterns(modules: Any) -> tuple[tuple[str, ...], tuple[RulePattern, ...]] | None:
    """``modules`` as a tuple of patterns and their compiled forms, or None (every module)."""
    if modules is None:
        return None
    if isinstance(modules, str) or not isinstance(modules, Sequence):
        raise TypeError(
            f"modules: expected a sequence of regular expressions or None, got "
            f"{type(modules).__name__} {modules!r}"
        )
    patterns, compiled = [], []
    for i, pattern in enumerate(modules):
        if not isinstance(pattern, str):
            raise TypeError(
                f"modules[{i}]: expected a regular expression string, got "
                f"{type(pattern).__name__} {pattern!r}"
            )
        compiled.append(_module_pattern(i, pattern))
        patterns.append(str.__str__(pattern))
    if not patterns:
        raise ValueError("modules: an empty sequence selects nothing; pass None for every module")
    return tuple(patterns), tuple(compiled)


def _module_pattern(i: int, pattern: str) -> RulePattern:
    """``modules[i]`` compiled as dynamic rule patterns are (bounded matching), or ValueError
    naming ``modules[i]``."""
    try:
        return _check_rule_pattern(pattern, pattern)
    except ValueError as exc:
        detail = str(exc).removeprefix("dynamic: rule key ")
        detail = detail.removeprefix(repr(pattern[:80]) + ("..." if len(pattern) > 80 else ""))
        raise ValueError(f"modules[{i}] {pattern[:80]!r}{detail}") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class GSQConfig:
    """Settings of the GSQ refinement of FP8 weight codes (``FP8Config(gsq=GSQConfig())``).

    Fields:
      enabled: run the refinement (a disabled config is carried and saved, and does nothing).
      candidates: codes per weight: the baseline byte and its ``candidates - 1`` nearest
        neighbours on the sorted grid of finite values, alternating below and above
        (2 to :data:`GSQ_MAX_CANDIDATES`).
      steps: Adam steps of the relaxation (≥ 1).
      learning_rate: Adam's step size on the candidate logits (> 0).
      temperature_start, temperature_end: the softmax temperature, annealed geometrically from
        the first to the second over the steps (both > 0, end ≤ start).
      seed: the private generator's seed (≥ 0): the same seed gives the same bytes on every
        device.
      modules: regular expressions; a module is refined when one matches its name from the
        start (``re.match``), None refines every FP8 module.
      max_candidate_bytes: the most bytes of decoded candidates (FP64) held at once; rows are
        refined in chunks under it (the result does not depend on it).
      learn_scales: must be False: the inverse scales stay frozen.

    Raises:
      TypeError: a field of the wrong kind.
      ValueError: a value out of range, an invalid ``modules`` pattern, ``learn_scales=True``.

    Numerics: names only; the algorithm is described in ``docs/gsq.md``.

    Example:
      >>> GSQConfig(steps=50, modules=[r".*mlp\\."]).modules
      ('.*mlp\\\\.',)
    """

    enabled: bool
    candidates: int
    steps: int
    learning_rate: float
    temperature_start: float
    temperature_end: float
    seed: int
    modules: tuple[str, ...] | None
    max_candidate_bytes: int
    learn_scales: bool
    _patterns: tuple[RulePattern, ...] = dataclasses.field(
        init=False, repr=False, compare=False, hash=False
    )

    def __init__(
        self,
        *,
        enabled: bool = True,
        candidates: int = 5,
        steps: int = 100,
        learning_rate: float = 0.1,
        temperature_start: float = 1.0,
        temperature_end: float = 0.05,
        seed: int = 0,
        modules: Sequence[str] | None = None,
        max_candidate_bytes: int = 1 << 30,
        learn_scales: bool = False,
    ) -> None:
        if _check_bool(learn_scales, where="learn_scales"):
            raise ValueError(
                "learn_scales: GSQ keeps the FP8 inverse scales frozen and re-chooses codes "
                "only; learn_scales=True is not supported"
            )
        start = _positive_real(temperature_start, where="temperature_start")
        end = _positive_real(temperature_end, where="temperature_end")
        if end > start:
            raise ValueError(
                f"temperature_end: got {end!r} above temperature_start {start!r}; the "
                f"temperature anneals downwards"
            )
        selected = _module_patterns(modules)
        set_field = object.__setattr__
        set_field(self, "enabled", _check_bool(enabled, where="enabled"))
        set_field(
            self,
            "candidates",
            _positive_int(candidates, where="candidates", low=2, high=GSQ_MAX_CANDIDATES),
        )
        set_field(self, "steps", _positive_int(steps, where="steps"))
        set_field(self, "learning_rate", _positive_real(learning_rate, where="learning_rate"))
        set_field(self, "temperature_start", start)
        set_field(self, "temperature_end", end)
        set_field(self, "seed", _positive_int(seed, where="seed", low=0, high=2**63 - 1))
        set_field(self, "modules", None if selected is None else selected[0])
        set_field(
            self,
            "max_candidate_bytes",
            _positive_int(max_candidate_bytes, where="max_candidate_bytes"),
        )
        set_field(self, "learn_scales", False)
        set_field(self, "_patterns", () if selected is None else selected[1])

    def selects(self, module_name: str) -> bool:
        """Whether the refinement runs on ``module_name``: enabled, and ``modules`` is None or
        one of its patterns matches the name from the start.

        Example:
          >>> GSQConfig(modules=[".*down_proj"]).selects("model.layers.0.mlp.down_proj")
          True
        """
        if not self.enabled:
            return False
        return not self._patterns or any(p.match(module_name) for p in self._patterns)
