"""Measurement: ``specplugin bench`` (side-by-side speed) and ``specplugin check-lossless``.

Each configuration runs in its own vLLM process (``engine.py``) on the same prompts
(``workloads.py``), compared against vLLM's own speculative methods (``methods.py``).

Modules: ``methods`` (compared configurations), ``workloads`` / ``instruct`` /
``chat_questions`` (prompts, no vLLM), ``families`` (a pair's cells and dtype),
``runner`` (the project's one way to start vLLM), ``engine`` (the child process),
``suite`` (rounds), ``report`` (table, PNG, JSON), ``search`` (built-ins' settings),
``lossless`` + ``tinymodel`` (losslessness checks), ``cli``, ``zoo_cli``, ``zoo_report``.

Nothing here is imported by the plugin; importing this package does not import vLLM
or torch (the CLI builds its parsers from it).
"""
