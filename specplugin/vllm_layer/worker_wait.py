"""What the plugin's worker does in its wait for the engine core's next call.

vLLM's worker process runs one call of the engine core at a time
(``WorkerProc._execute_worker_rpc``: run it, send the reply when this rank sends one),
then waits on its message queue for the next; meanwhile the engine core schedules the
next step. The learning a step held back (:mod:`specplugin.adaptive.background`) runs
right after each call, in that wait, and so does the publishing of the plugin's counters
for ``/metrics`` (:mod:`specplugin.vllm_layer.metrics_export`). vLLM has no hook there;
the patch is installed in every process by ``register()``, and runs only in workers,
where the method lives.
An in-process engine (no worker process) never calls it: there the held learning runs
at the start of the next step instead, as the core does without a worker, and the
counters are published at the start of a step.
"""

from __future__ import annotations


def after_worker_rpc(proc, *args, **kwargs) -> None:
    """After ``WorkerProc._execute_worker_rpc``: the plugin's worker uses its wait
    (:meth:`~specplugin.vllm_layer.worker.PluginWorkerMixin.use_the_wait`); any other
    worker does nothing. Never raises (a learning job's failure is counted where it ran,
    a failed publish switches publishing off with one logged error)."""
    run = getattr(getattr(proc.worker, "worker", None), "use_the_wait", None)
    if run is not None:
        run()


def install() -> None:
    """Worker side (``register()``, every process)."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    from specplugin.vllm_layer import patches

    if not patches.is_patched(WorkerProc, "_execute_worker_rpc"):
        patches.patch_method(WorkerProc, "_execute_worker_rpc", after_worker_rpc)
