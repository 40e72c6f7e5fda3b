"""sgl_fair.workloads: arrival processes, traces, programs and named experiments."""
