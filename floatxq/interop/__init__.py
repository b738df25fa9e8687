"""Checkpoint interop: the files, payloads and layouts floatxq reads and writes.

- :mod:`~floatxq.interop.checkpoint`: safetensors shards and JSON files, written atomically;
- :mod:`~floatxq.interop.payload`: configs to and from ``quantization_config`` payloads;
- :mod:`~floatxq.interop.layouts`: which layout a directory holds and how each is read;
- :mod:`~floatxq.interop.export`: the tensors and payloads a save writes for each reader;
- :mod:`~floatxq.interop.sources`: other producers' native FP8 / NVFP4 / MX tensors;
- :mod:`~floatxq.interop.inspect`: what a checkpoint is, without building a model.
"""
