"""Memory planner: the bytes each rank of a (tp, pp, dp) layout will hold, worked out on the meta device.

For every pipeline rank, a meta copy of the model is cut by the strategy's own setup steps (``steps.run(until="coverage")``),
the same functions: ``pipeline.build.prepare_stages`` (``find_block_sequences`` + ``plan_partition``, balanced
by parameters or by the given block counts; other stages' units become stand-ins, tied weights stay on every stage
that uses them) -> ``tensor_parallel.detect`` + the Hugging Face plan + ``tp_plan`` -> ``apply_plan``. The
parameters left on that copy are the rank's own, in their tensor-parallel shapes::

    per rank (pp rank, tp rank)      params  +  grads  +  optimizer state  +  activations held by the schedule
    params, grads                    the copy's parameters (trainable ones for grads), in param_dtype
    optimizer state                  states per parameter (AdamW 2, SGD with momentum 1, SGD 0) + AdamW's step
    activations                      (bytes saved for backward per micro-batch, per stage)
                                       x (micro-batches the schedule holds at once on that rank)

Activations are measured, not modelled: the model's forward (and a cross-entropy on its logits, or a Hugging Face
model's own loss) runs on the meta copy of each pipeline rank, parallel layers included (collectives return the
shapes they would), for one micro-batch of ``batch_size / dp / microbatches`` sequences of ``seq_len`` tokens, under
``torch.autograd.graph.saved_tensors_hooks``: each tensor autograd keeps for backward (parameters excepted) is counted
once, on the pipeline stage whose module was running (``scaled_dot_product_attention`` as the fused kernels real
devices run keeps it: q, k, v, output, log-sum-exp; the meta device's math path would keep seq x seq
probabilities). A stage other than the last also holds the outputs it sent
until their gradients come back. With activation checkpointing every block runs under non-reentrant
``torch.utils.checkpoint``, which keeps only the block's inputs; one block's full activations come back while it
recomputes. How many micro-batches a rank holds comes from the schedule's own action lists (``pipeline.schedule``):
a micro-batch is held from its ``F`` until its ``B`` (or its ``W`` when the backward is split; an upper bound).

``dp_shard=True`` is the strategy's default with dp > 1, FSDP2 over dp (``fully_shard``: every parameter's dim 0 cut
into dp pieces, padded): parameters, gradients and optimizer state are divided by dp, and ``gathered`` counts what
FSDP2 holds whole beside them (the largest unit's gathered parameters, unsharded gradient and reduce-scatter input,
the next block prefetched; the whole stage's parameters and gradients under zero-bubble schedules).
``dp_shard=False`` is ``dp_sharding="no_shard"`` (replication over dp). The optimizer step is a moment of its own
(``step``): torch's default Adam/AdamW (``foreach``) allocates one temporary the size of the rank's parameters
(``sqrt`` of the second moments) beside the states. Not counted: framework and allocator overhead, communication
buffers, temporaries that are not saved for backward (e.g. the loss's gradient).
"""

from lightning_tpp.memory.estimate import GiB, OPTIMIZER_STATES, MemoryReport, RankMemory, estimate_memory

__all__ = ["GiB", "OPTIMIZER_STATES", "MemoryReport", "RankMemory", "estimate_memory"]
