"""sgl_fair.worker.sim: the simulated engine (roofline cost model) and discrete-event runner."""
