"""The torch engine: a Llama-architecture model in plain torch behind the ``Engine`` protocol.

Importing this package imports torch (``import sgl_fair.worker`` does not). Modules:
``model`` (``LlamaConfig``, ``LlamaModel``: random ``tiny`` preset or a local Hugging Face
checkpoint), ``engine`` (``TorchEngine``: KV pools addressed by the allocator's slots, paged
attention, sampling), ``runner`` (``make_torch_worker``: scheduler + engine).
"""
