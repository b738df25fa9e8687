"""INT4 weights with low-precision activations (W4A16, W4A-FP8, W4A-NVFP4) as pure functions.

- :mod:`~floatxq.w4a.linear`: the pure references of the three GEMMs;
- :mod:`~floatxq.w4a.activation`: the activation carrier handed from a producer to its consumers.
"""
