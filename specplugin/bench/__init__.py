"""Measurement: ``specplugin bench`` (side-by-side speed) and ``specplugin check-lossless``.

Every later change to the plugin is judged by these two instruments, so they run
real vLLM engines, each configuration in its own process (``engine.py``), fed the
same prompts (``workloads.py``), and compare against vLLM's own speculative
methods (``methods.py``).

Modules:
- ``methods``: the table of compared configurations (``none``, ``vllm-*``, ``plugin-*``)
  and the built-ins' recorded settings.
- ``workloads``: edit / complete / mixed / adversarial prompts as token ids (no vLLM).
- ``instruct`` (with ``chat_questions``): code-edit / explain / chat / chat-mix requests
  for a real instruct model, through its chat template, stopping at EOS (no vLLM).
- ``families``: which of the two a pair runs (a chat template makes an instruct pair),
  its default cells and its dtype.
- ``runner``: the project's one way to start vLLM (the bench, the search, the lossless
  check, the demo, ``zoo report`` and the end-to-end tests all use it): engine defaults,
  child environment, the plugin's switch, compiled or ``--eager``; starts children one at
  a time and follows their progress; ``run_engine`` for one call.
- ``engine``: the child process: one engine, warm-up, all cells, vLLM's counters.
- ``suite``: configurations interleaved over rounds, with a progress display.
- ``report``: medians, speedups, the rich table, the PNG, the JSON.
- ``search``: the sweep that chose the built-ins' settings.
- ``lossless``: greedy token-for-token and sampled chi-square checks.
- ``tinymodel``: the tiny-vocabulary Llama pair the sampled check draws from.
- ``cli``: ``specplugin bench``.
- ``zoo_cli``, ``zoo_report``: ``specplugin zoo`` (build the pair, print its folders) and
  ``specplugin zoo report`` (the pair measured under vLLM); the pair itself is ``specplugin.zoo``.

Nothing here is imported by the plugin, and importing this package does not import
vLLM or torch (the CLI builds its parsers from it).
"""
