"""``compile=``: this rank's blocks compiled (regional ``torch.compile``), and the ``compile/`` metrics.

The blocks are compiled at the end of the first training step (a recomputed block's own forward, inside its
checkpoint), each as it then is (tensor, sequence, context and expert parallelism, activation checkpointing and FSDP2
in place; dynamo runs FSDP2's hooks outside its graphs). The first step runs them eagerly: their first-call checks
and the branches a block takes once (its first call, its first training call, its first dropout draw) never enter a
graph, which would otherwise recompile at the second step. The first-call checks are also
``torch.compiler.disable``'d, should a block be compiled by its user. On its first compiled call each block is
checked against its eager forward (see ``Compiled._compiled``).

Logged through Lightning's loggers every ``log_every_n_steps``::

    compile/graphs         graphs dynamo compiled in this process (a block's, and one more per graph break it
                           resumes after)
    compile/graph_breaks   graph breaks met while compiling them (each distinct reason listed once after the first
                           compiled step, with the blocks' count)
    compile/recompiles     graphs compiled during training steps after the first compiled one: 0 in steady state
                           (the first validation batch compiles the evaluation graphs, outside training steps; an
                           epoch's short last batch compiles nothing: the batch and sequence sizes are marked dynamic)

Cumulative, this rank's (dynamo's counters are per process)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_tpp._compat import (allow_graphs_per_function, capture_scalar_outputs, compile_call, dynamo_counters,
                                   hf_records_outside_graphs, maybe_mark_dynamic, outside_saved_tensors_hooks,
                                   tree_flatten, tree_unflatten)
from lightning_tpp.context_parallel.blocks import compile_positions
from lightning_tpp.core.comm import TPGroup, all_reduce_flag
from lightning_tpp.core.reference import (_graded, _leaves, _records_kept, evaluating, first_difference, isolated,
                                          output_gradient, units_gathered)
from lightning_tpp.core.recompute import compile_inside, is_recomputed
from lightning_tpp.core.seeding import global_state_digest
from lightning_tpp.core.walk import get_arg, stream_index
from lightning_tpp.experts.expert_parallel import is_split_bank
from lightning_tpp.pipeline.metrics import is_logging_step
from lightning_tpp.pipeline.stage import compile_dispatched
from lightning_tpp.tensor_parallel.rng import copies_followed, own_draws_kept
from lightning_tpp.tensor_parallel.sequence import compile_sequence

PREFIX = "compile/"


def dynamo_counts() -> tuple[int, int, dict[str, int]]:
    """(graphs compiled, graph breaks, graph breaks by reason) in this process so far."""
    counters = dynamo_counters()
    breaks = dict(counters["graph_break"])
    return int(counters["stats"]["unique_graphs"]), sum(breaks.values()), breaks


def _compare(block: nn.Module, eager: Callable[..., Any], graph: Callable[..., Any], args: tuple, kwargs: dict,
             before: Callable[[tuple, dict], None]) -> Optional[str]:
    """The first difference between a block's compiled call and its eager one on copies of this call's inputs (their
    varying sizes marked by ``before``, as the call's are): in the block's own mode, with gradients, so that the graph
    compared is the one the steps run, forward and backward (:func:`_trained_difference`). A block that draws random
    numbers there (dropout, a router's noise: the generator moved in its eager call) is compared in eval mode
    instead, its forward only: a compiled graph's draws are not eager's (inductor makes its own). That runs under
    ``inference_mode`` (a validation pass's graph, compiled here once)."""
    try:
        problem = _trained_difference(block, eager, graph, args, kwargs, before)
        if problem is not _DREW:
            return problem
        with torch.inference_mode(), evaluating(block), _records_kept():
            a, k = isolated(args, kwargs)
            want = eager(*a, **k)
            a, k = isolated(args, kwargs)
            got = graph(*a, **k)
        return first_difference(got, want, _ALONE)
    except Exception as err:  # noqa: BLE001 - reported on every rank, with the block's name
        return f"it raised {type(err).__name__}: {err}"


_DREW = "random draws"  # _trained_difference: the eager call drew random numbers (nothing compared)
_ALONE = TPGroup(None, 0, 1)  # the two calls are this rank's: compared as they are


def _trained_difference(block: nn.Module, eager: Callable[..., Any], graph: Callable[..., Any], args: tuple,
                        kwargs: dict, before: Callable[[tuple, dict], None]) -> Optional[str]:
    """The block's eager call, then its compiled one, with gradients, each on its own leaf copies of the inputs: the
    outputs, then the gradients of the inputs and of the block's parameters for one random output gradient (the same
    for both; each call's backward runs before the next call, whose buffer updates would invalidate what it saved).
    FSDP2's units in the block are gathered with their hooks off (:func:`units_gathered`), outside the saved tensors'
    hooks of a recomputed block's checkpoint; each call starts from the block's buffers as they were (a norm's
    running statistics, updated in training mode) and from the strategy's own stream as it was (dropout over tp
    shards: the same masks in both calls), and they, the random generators and the layers' records are as before
    after. Returns :data:`_DREW` where the eager call drew random numbers from the global generators."""
    device = next((p.device for p in block.parameters()), torch.device("cpu"))
    with units_gathered(block, itself=True), outside_saved_tensors_hooks(), _records_kept(), \
            _buffers_kept(block) as restore, own_draws_kept() as recount, torch.enable_grad(), \
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        params = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
        start = global_state_digest(device)
        cotangent: list[Tensor] = []

        def run(call: Callable[..., Any]) -> tuple[Any, Optional[tuple]]:
            a, k, inputs = _leaves(args, kwargs)
            copies_followed(tree_flatten((args, kwargs))[0], tree_flatten((a, k))[0])
            before(a, k)
            out = call(*a, **k)
            graded = _graded(out)
            if graded is None:
                return out, None
            if not cotangent:
                cotangent.append(output_gradient(graded))
            if graded.shape != cotangent[0].shape:
                return out, None
            names = [f"input {key[1]!r}" for key, _ in inputs] + [repr(n) for n, _ in params]
            grads = torch.autograd.grad(graded, [t for _, t in inputs] + [p for _, p in params], cotangent[0],
                                        allow_unused=True)
            return _detached(out), tuple(zip(names, grads))

        want, theirs = run(eager)
        if global_state_digest(device) != start:
            return _DREW
        restore()
        recount()  # dropout over tp shards: the same keys and draws, so the same masks, as the eager call
        got, mine = run(graph)
    problem = first_difference(got, want, _ALONE)
    if problem is not None or theirs is None or mine is None:
        return problem
    for (name, w), (_, g) in zip(theirs, mine):
        if g is None and w is None:
            continue
        # no gradient is a zero one (a compiled graph's backward gives zeros for an input its output does not read)
        problem = first_difference(torch.zeros_like(w) if g is None else g, torch.zeros_like(g) if w is None else w,
                                   _ALONE, f"gradient of {name}")
        if problem is not None:
            return problem
    return None


def _detached(out: Any) -> Any:
    leaves, spec = tree_flatten(out)
    return tree_unflatten([t.detach() if isinstance(t, Tensor) else t for t in leaves], spec)


@contextlib.contextmanager
def _buffers_kept(block: nn.Module) -> Iterator[Callable[[], None]]:
    """The block's buffers put back after a check's calls (a norm's running statistics, updated in training mode);
    the function given puts them back in between."""
    saved = [(b, b.clone()) for b in block.buffers() if not b.is_meta]

    def restore() -> None:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)

    try:
        yield restore
    finally:
        restore()


def _mark_varying(args: tuple, kwargs: dict) -> None:
    """Before each compiled call of a block: the sizes that vary between batches, the batch and the stream's sequence
    (an epoch's short last batch, a validation batch, a padded-per-batch length), are compiled as symbols wherever
    an input has them, so that a new size recompiles nothing."""
    where = stream_index(args, kwargs)
    stream = get_arg(args, kwargs, where) if where is not None else None
    if not isinstance(stream, Tensor) or stream.dim() < 2:
        return
    sizes = {stream.shape[0], stream.shape[1]} if stream.dim() >= 3 else {stream.shape[0]}
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, Tensor):
            for d, n in enumerate(t.shape):
                if n > 1 and n in sizes:
                    maybe_mark_dynamic(t, d)


class CompiledMismatchError(RuntimeError):
    """A compiled block's output differs from its eager forward's on the same inputs."""


class Compiled:
    """The blocks to compile, compiled after the first training step; dynamo's counters from then on."""

    def __init__(self, module: Any, blocks: list[str], options: Union[bool, Mapping[str, Any]],
                 check: bool = True) -> None:
        self.module, self.blocks = module, blocks
        self.options = {} if options is True else dict(options)  # type: ignore[arg-type]
        self.check = check  # each block's first compiled call against its eager forward
        self.problems: list[str] = []  # what those checks found on this rank
        self.steps = 0  # training steps finished
        self.recompiles = 0
        self._before: Optional[int] = None
        self._set_up = False  # the blocks compiled (at the start of the second training step)

    def _compiled(self, name: str, block: nn.Module, before: Callable[[tuple, dict], None],
                  eager: Callable[..., Any]) -> Callable[..., Any]:
        """``eager`` (the block's call, or its own forward when recomputed) compiled; before each call ``before``
        marks its inputs; the first call is also checked against ``eager``."""
        compiled = torch.compile(eager, **self.options)
        pending = [self.check]

        def graph(*args: Any, **kwargs: Any) -> Any:
            with hf_records_outside_graphs():
                return compiled(*args, **kwargs)

        def call(*args: Any, **kwargs: Any) -> Any:
            before(args, kwargs)
            if pending[0]:
                pending[0] = False
                problem = _compare(block, eager, graph, args, kwargs, before)
                if problem is not None:
                    self.problems.append(f"{name!r} ({type(block).__name__}): {problem}")
            return graph(*args, **kwargs)

        return call

    def _agree(self) -> None:
        """After the first compiled step, every rank: raise on all of them when a check found a difference on any."""
        if all_reduce_flag(not self.problems, None):
            return
        raise CompiledMismatchError(
            "compile=: a compiled block does not compute what its eager forward computes on the same inputs "
            f"({'; '.join(self.problems) or 'on another rank'}). This is a bug of torch.compile or of the block's "
            "compiled form: train with compile=False, or another backend (compile={'backend': 'aot_eager'}), and "
            "report it with TORCH_LOGS=graph_code")

    def before_step(self) -> None:
        """Called at the start of the strategy's ``training_step``: the blocks compiled at the second one (not at the
        end of the first, before its backward: a recomputed block would recompute with the compiled forward what its
        forward ran eagerly, and save another number of tensors, ``CheckpointError``)."""
        if self.steps == 1 and not self._set_up:
            self._set_up = True
            self._compile_blocks()
        self._before = dynamo_counts()[0]

    def _compile_blocks(self) -> None:
        allow_graphs_per_function(2 * len(self.blocks) + 8)  # a training and an evaluation graph per block
        if any(is_split_bank(m) for name in self.blocks for m in self.module.get_submodule(name).modules()):
            capture_scalar_outputs()  # the expert exchange traced: its split sizes are read from the routing
        # dynamic=False: every size a constant (a new one recompiles); True: dynamo marks every size itself
        before = _mark_varying if self.options.get("dynamic") is None else (lambda args, kwargs: None)
        for name in self.blocks:
            block = self.module.get_submodule(name)
            make = functools.partial(self._compiled, name, block, before)
            if compile_positions(block, make) or compile_sequence(block, make):
                pass
            elif is_recomputed(block):
                compile_inside(block, make)
            elif not compile_dispatched(block, make):
                compile_call(block, make)

    def after_step(self, module: Any, batch_idx: Optional[int]) -> None:
        """Called at the end of the strategy's ``training_step`` on every rank."""
        self.steps += 1
        graphs, breaks, reasons = dynamo_counts()
        if self.steps == 1:
            return
        if self.steps == 2 and self.check:
            self._agree()
        if self.steps == 2 and graphs == 0:
            rank_zero_warn(f"compile=: {len(self.blocks)} blocks were compiled but dynamo made no graph of them: they "
                           "run eagerly. Run with TORCH_LOGS=graph_breaks to see why")
        if self.steps == 2 and reasons:
            lines = [f"  {count} x {reason.splitlines()[0]}" for reason, count in reasons.items()]
            rank_zero_info(f"compile=: {len(self.blocks)} blocks compiled with {breaks} graph breaks:\n"
                           + "\n".join(lines))
        if self.steps > 2 and self._before is not None:
            self.recompiles += graphs - self._before
        if not is_logging_step(module.trainer, batch_idx):
            return
        module.log_dict({f"{PREFIX}graphs": float(graphs), f"{PREFIX}graph_breaks": float(breaks),
                         f"{PREFIX}recompiles": float(self.recompiles)}, on_step=True, on_epoch=False,
                        prog_bar=False, logger=True)
