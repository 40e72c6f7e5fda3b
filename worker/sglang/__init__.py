"""SGLang backend: sgl-fair's local policies inside SGLang 0.5.23's own scheduler process.

* ``settings`` (pure): how the plugin is switched on — environment variables the launcher sets.
* ``plugin``: the ``sglang.srt.plugins`` entry point; registers the hooks when switched on.
* ``adapter``: the hooks — our policy orders SGLang's waiting queue and is charged from what
  SGLang actually admitted, decoded, finished, aborted and retracted.
* ``bridge``: one SGLang server behind our router, speaking the router's worker protocol.
* ``http_api``: what SGLang's HTTP API carries (``/generate`` bodies, SSE, server info).
* ``servers``: the SGLang server processes ``launch --backend sglang`` starts and stops.

Only ``adapter`` and ``plugin`` import sglang; the rest imports on any machine.
"""
