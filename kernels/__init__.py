"""sgl_fair.kernels: Triton bidirectional paged attention and its torch reference."""
