"""sgl_fair.worker: one process per GPU — the continuous-batching scheduler and its engines."""
