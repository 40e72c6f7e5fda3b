"""sgl_fair.kernels: Triton bidirectional paged attention and its torch reference.

Modules (each imports torch; this package's ``__init__`` does not, so ``import sgl_fair.kernels``
stays free for the pure core and the other layers):

* ``block_table``: ``BlockTable`` (a batch's pieces ``(block, direction, offset, length)`` as
  padded int32 tensors), ``write_kv``, ``pieces_from_slots`` (a sequence's flat slots, as the
  worker's exact KV cache gives them, back into pieces), and layouts for tests and
  benchmarks (``forward_pieces``, ``bidirectional_pieces``).
* ``reference``: the spec in plain torch: ``decode_attention_ref``, ``extend_attention_ref``,
  ``gather_kv``.
* ``bidir_attention``: the Triton kernels ``decode_attention`` and ``extend_attention`` (also
  imports triton).

docs/kernels.md describes the format, the contract and the tolerances.
"""
