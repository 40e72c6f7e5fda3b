"""sgl_fair.worker.kv: KV-cache allocators behind one check-then-commit interface."""
