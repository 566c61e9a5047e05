"""How the Trainer starts the ranks: the strategy's ``_configure_launcher`` asks :func:`make_launcher`.

- ``popen`` (the default outside notebooks): Lightning's subprocess-script launcher runs the script again per rank.
- ``spawn``/``fork``/``forkserver`` (notebooks): :class:`WholeWeightsLauncher` starts the ranks from this process and
  hands the trained weights back to the main process's model. Each worker holds shards (tp) and one stage (pp), so
  the weights handed back are the whole tensors, gathered on every rank (a collective) and put in place of rank 0's
  ``state_dict`` through torch's public ``register_state_dict_post_hook`` (removed right after).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_tpp._compat import MultiProcessingLauncher, SubprocessScriptLauncher


class WholeWeightsLauncher(MultiProcessingLauncher):
    """spawn/fork launcher that hands whole tensors (not rank 0's shards) back to the main process's model, and
    destroys the process group when a worker is done (its process ends with ``os._exit``, skipping atexit)."""

    @override
    def run_worker(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().run_worker(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    @override
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        # data only (module names, styles, block layouts), as bytes: Lightning walks the extras with
        # apply_to_collection, which refuses the plan's frozen dataclasses; the queue pickles anyway
        extra["lightning_tpp_plan"] = pickle.dumps(self._strategy.plan)
        return extra

    @override
    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        plan = extra.pop("lightning_tpp_plan", None)
        super().update_main_process_results(trainer, extra)
        if plan is not None:  # trainer.strategy.plan in the main process (a notebook) is rank 0's
            self._strategy.worker_plan = pickle.loads(plan)  # our own worker's bytes, through Lightning's queue

    @override
    def collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        full = self._strategy.whole_model_state()  # collective: every rank runs this method

        def whole(module: Any, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            state.clear()
            state.update(full)

        handle = trainer.lightning_module.register_state_dict_post_hook(whole)
        try:
            return super().collect_rank_zero_results(trainer, results)
        finally:
            handle.remove()


def is_interactive() -> bool:
    """A notebook or ``python -i`` (Lightning's own test): the script cannot be run again per rank."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def make_launcher(strategy: Any, start_method: str) -> Any:
    """The launcher for ``start_method`` (``"auto"``: ``"fork"`` in notebooks, else ``"popen"``)."""
    assert strategy.cluster_environment is not None
    method = start_method
    if method == "auto":
        method = "fork" if is_interactive() else "popen"
    if method == "popen":
        return SubprocessScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    return WholeWeightsLauncher(strategy, start_method=method)
