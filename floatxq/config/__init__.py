"""Frozen configs and ``str`` enums: METHOD, FORMAT, BACKEND, dynamic rules, FP8Config, GPTQConfig,
and the W4A activation policy (ActivationConfig).

Nothing here touches tensor data. One file per concept, each importing only those before it:

- :mod:`~floatxq.config.values`: the enums, read-only JSON-like values, the scalar checks;
- :mod:`~floatxq.config.rules`: per-module ``dynamic`` rules and the bound on their matching time;
- :mod:`~floatxq.config.activation`: :class:`ActivationConfig` and its refinements;
- :mod:`~floatxq.config.gsq`: :class:`GSQConfig` (FP8 code refinement);
- :mod:`~floatxq.config.weights`: :class:`FP8Config` and :class:`GPTQConfig`;
- :mod:`~floatxq.config.nvfp4`: :class:`NVFP4Config`.

Every name is re-exported here; import from ``floatxq.config`` (or ``floatxq``).
"""

from floatxq.config.activation import (
    ActivationAttentionConfig,
    ActivationConfig,
    ActivationMlpConfig,
    backend_for_activation,
)
from floatxq.config.gsq import GSQConfig
from floatxq.config.nvfp4 import NVFP4Config
from floatxq.config.rules import (
    RULE_MATCH_TIMEOUT_S,  # noqa: F401 - importable, not public (the rule bounds)
    RULE_NAME_MAX_CHARS,  # noqa: F401
    RULE_PATTERN_MAX_CHARS,  # noqa: F401
    DynamicRule,
    DynamicRuleNormalizer,
    DynamicRules,
)
from floatxq.config.values import (
    BACKEND,
    FORMAT,
    METHOD,
    _FrozenMapping,  # noqa: F401 - the activation stream's
)
from floatxq.config.weights import FP8Config, GPTQConfig

__all__ = [
    "BACKEND",
    "FORMAT",
    "METHOD",
    "ActivationAttentionConfig",
    "ActivationConfig",
    "ActivationMlpConfig",
    "DynamicRule",
    "DynamicRuleNormalizer",
    "DynamicRules",
    "FP8Config",
    "GPTQConfig",
    "GSQConfig",
    "NVFP4Config",
    "backend_for_activation",
]
