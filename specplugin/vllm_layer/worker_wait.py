"""Run the plugin's between-call work while the worker waits for the engine core.

After each ``WorkerProc._execute_worker_rpc`` the worker idles until the next call;
the plugin runs its held-back learning (:mod:`specplugin.adaptive.background`) and
publishes ``/metrics`` counters there. vLLM has no hook, so ``register()`` patches it.
An in-process engine (no worker process) never calls it: the work runs at the start
of the next step instead.
"""

from __future__ import annotations


def after_worker_rpc(proc, *args, **kwargs) -> None:
    """After ``WorkerProc._execute_worker_rpc``: call the plugin worker's ``use_the_wait``
    (other workers: nothing). Never raises."""
    run = getattr(getattr(proc.worker, "worker", None), "use_the_wait", None)
    if run is not None:
        run()


def install() -> None:
    """Worker side (``register()``, every process)."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    from specplugin.vllm_layer import patches

    if not patches.is_patched(WorkerProc, "_execute_worker_rpc"):
        patches.patch_method(WorkerProc, "_execute_worker_rpc", after_worker_rpc)
