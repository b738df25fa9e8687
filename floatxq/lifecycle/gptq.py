"""GPTQ in the lifecycle, as far as it goes today: a resolved config becomes the solver's options.

:class:`~floatxq.config.GPTQConfig` describes a checkpoint (per-module rules, packing format,
``lm_head``, ``meta``); :func:`floatxq.gptq_solve` needs only the solver's settings. The
layer-by-layer GPTQ lifecycle (calibration capture, Hessians, packing) is not available yet in
``floatxq.load``.
"""

from floatxq.config import GPTQConfig
from floatxq.gptq import GPTQSolveOptions


def gptq_solve_options(config: GPTQConfig) -> GPTQSolveOptions:
    """The solver options of one module's settings (``config.resolve(module_name)``).

    Raises:
      TypeError: ``config`` is not a :class:`~floatxq.config.GPTQConfig`.
      ValueError: ``config`` still has ``dynamic`` rules (resolve them for a module first).

    Numerics: names only; the solver is described in ``docs/numerics.md``.

    Example:
      >>> cfg = GPTQConfig(bits=3, dynamic={r".*down_proj": {"bits": 8}})
      >>> gptq_solve_options(cfg.resolve("model.layers.0.mlp.down_proj")).bits
      8
    """
    if not isinstance(config, GPTQConfig):
        raise TypeError(f"config: expected a GPTQConfig, got {type(config).__name__}")
    if config.dynamic is not None:
        raise ValueError(
            f"config: has {len(config.dynamic)} dynamic rule(s), so its settings differ by "
            f"module; pass config.resolve(module_name) for the module being solved"
        )
    return GPTQSolveOptions(
        bits=config.bits,
        group_size=config.group_size,
        sym=config.sym,
        desc_act=config.desc_act,
        static_groups=config.static_groups,
        act_group_aware=config.act_group_aware,
        damp_percent=config.damp_percent,
        damp_auto_increment=config.damp_auto_increment,
        mse=config.mse,
    )


__all__ = ["gptq_solve_options"]
