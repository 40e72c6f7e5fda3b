"""sgl_fair.router: the global router process (D2LPM over a global radix tree)."""
