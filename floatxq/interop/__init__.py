"""Checkpoint interop: the files, payloads and layouts floatxq reads and writes.

- :mod:`~floatxq.interop.checkpoint`: model directories written atomically; shared file names;
- :mod:`~floatxq.interop.shards`: safetensors shards, headers and JSON files, checked as read;
- :mod:`~floatxq.interop.stream_shards`: ``write_checkpoint``'s shards written tensor by tensor;
- :mod:`~floatxq.interop.payload`: configs to and from ``quantization_config`` payloads;
- :mod:`~floatxq.interop.layouts`: which layout a directory holds, decided from its metadata;
- :mod:`~floatxq.interop.readers`: how each layout's module tensors become modules;
- :mod:`~floatxq.interop.export`: the tensors and payloads a save writes for each reader;
- :mod:`~floatxq.interop.export_gptq`: GPTQ modules in ``gptq`` and ``pack-quantized`` files;
- :mod:`~floatxq.interop.export_modelopt`: ModelOpt's NVFP4 metadata (``hf_quant_config.json``);
- :mod:`~floatxq.interop.sources`: other producers' native FP8 / NVFP4 / MX tensors;
- :mod:`~floatxq.interop.inspect`: what a checkpoint is, without building a model.
"""
