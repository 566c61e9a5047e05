"""Lightning's step hooks under a pipeline: ``training_step`` runs the schedule (forward and backward of every
micro-batch, the user's own ``training_step`` on the last stage), ``validation/test/predict_step`` run it forward
only, and ``backward`` then only restores the gradients the schedule parked (Lightning zeroes gradients after the
step inside its closure). ``self.log`` inside the schedule is captured and replayed once, on every rank."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.pipeline.logging import captured_logs, replay_logs


class PipelineSteps:
    """Strategy mixin. Expects ``lightning_module``, ``precision_plugin``, ``_engine`` (None without a pipeline) and
    ``_skip_backward`` (a step skipped everywhere for a non-finite loss)."""

    lightning_module: Any
    precision_plugin: Any
    _engine: Optional[PipelineEngine]
    _skip_backward: bool

    def _pipeline_training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and module.trainer is not None

        def step(micro: Any) -> Any:
            with self.precision_plugin.train_step_context():
                return module.training_step(micro, *args[1:], **kwargs)

        accumulate = module.trainer.accumulate_grad_batches
        executor = self._engine.executor
        with captured_logs(module, share=lambda: executor.share) as logs:  # micro-batches' values weighted by share
            loss = self._engine.train_step(step, args[0], loss_scale=1.0 / accumulate,
                                           stale_grads=self._zeroed_after_step(module, args, accumulate))
        replay_logs(self._engine, module, logs)
        return loss

    @staticmethod
    def _zeroed_after_step(module: Any, args: tuple, accumulate: int) -> bool:
        """Lightning zeroes the gradients right after this ``training_step`` (the first batch of an accumulation
        window, ``automatic.py``'s ``_make_zero_grad_fn``) and nobody looks at the old ones in between: no
        ``optimizer_zero_grad`` or ``on_before_zero_grad`` of the user's. Then the old ones can go before the
        schedule instead of after it."""
        batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else None
        if batch_idx is None or batch_idx % accumulate:
            return False
        if any(is_overridden(hook, module) for hook in ("optimizer_zero_grad", "on_before_zero_grad")):
            return False
        return not any(is_overridden("on_before_zero_grad", cb, parent=Callback) for cb in module.trainer.callbacks)

    def _pipeline_eval(self, hook: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and self._engine is not None

        def step(batch: Any) -> Any:
            with context():
                return getattr(module, hook)(batch, *args[1:], **kwargs)

        executor = self._engine.executor
        if len(args) > 1 and isinstance(args[1], int) and args[1] == 0:  # a new loop or dataloader: batch_idx 0
            executor.forget_results()
        with captured_logs(module, share=lambda: executor.share) as logs:  # micro-batches' values weighted by share
            out = self._engine.eval_step(step, args[0], hook)
        replay_logs(self._engine, module, logs)
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline_eval("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline_eval("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().predict_step(*args, **kwargs)
        return self._pipeline_eval("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Under a pipeline the schedule already ran backward inside ``training_step``: run the hooks and restore
        the parked gradients instead of differentiating the (detached) step loss."""
        if self._engine is None and not self._skip_backward:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        if self._engine is not None and not self._skip_backward:
            self._engine.restore_grads()
        self._skip_backward = False
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss
