"""Collection rules for the doctest run over ``floatxq`` (``--doctest-modules floatxq``)."""

try:  # MLX's modules import it at module level; without it their doctests are not collected
    import mlx.core  # noqa: F401

    collect_ignore_glob: list[str] = []
except Exception:  # not installed, or installed without a backend for this machine
    collect_ignore_glob = ["floatxq/mlx/*", "floatxq/testing/mlx.py"]
