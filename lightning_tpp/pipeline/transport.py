"""Point-to-point traffic between pipeline stages: one bundle of tensors per micro-batch, stage pair and direction.

Sends are asynchronous (``isend``, waited at the end of the step by :meth:`Transport.flush`); receives block when the
data is needed. The receiver learns shapes and dtypes from a small header sent before each bundle, so a new sequence
length or dtype is simply a new header: nothing is negotiated once and then trusted::

    header  (kind 0):  per tensor [dtype code, requires_grad, ndim, dim0, ..., dim7]   int64
    tensors (kind 1):  the bundle's tensors, one message each                          as the header says
    grads   (kind 2):  the gradients of those that require grad, sent back             shapes known to the sender

Receives can be posted ahead (every header of a step when it starts, each gradient right after its forward) so a
transfer happens while the rank computes; that needs messages matched by tag, as gloo does. NCCL matches a pair's
messages in posting order, so there (``early=False``) receives are posted only when needed, in send order.

For the metrics, the timeline and the hang report the transport keeps, at the cost of two ``perf_counter`` reads
per send and per wait: the seconds spent sending and blocked receiving (``sent``, ``waited``), the message this rank
is blocked on right now (``blocked``), and, while a timeline records, every send and blocking receive as a span.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_tpp.pipeline.errors import PipelineError

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # dtype, requires_grad, ndim, dims...
_MAX_LEAVES = 64  # tensors per bundle

Posted = tuple[Tensor, Any]  # a receive buffer and its pending work
Message = tuple[str, int, int, int]  # what ("activations", "gradients"), micro-batch, sending stage, receiving stage
# "receive" or "send", the message, the peer's rank, since, and until (perf_counter; None while it waits: a wait that
# raised, when a peer's connection closed, stays recorded until the next, for the failure's report)
Blocked = tuple[str, Message, int, float, Optional[float]]
CommSpan = tuple[str, Message, int, float, float]  # "receive" or "send", the message, peer rank, start, end


class _Delivery:
    """A receive from a stage on this same rank (interleaved stages: values that skip a stage, e.g. a residual
    stream summed outside the blocks): the message is taken from the rank's own mailbox when waited for."""

    def __init__(self, mailbox: dict[int, Tensor], tag: int, buf: Tensor) -> None:
        self.mailbox, self.tag, self.buf = mailbox, tag, buf

    def wait(self) -> None:
        if self.tag not in self.mailbox:
            raise PipelineError(f"a pipeline message to this rank's own stage (tag {self.tag}) was awaited before "
                                f"it was sent")
        self.buf.copy_(self.mailbox.pop(self.tag))


class Transport:
    """Sends and receives of one pipeline (the ranks sharing this rank's dp and tp coordinates).

    Args:
        group: the pipeline's process group.
        stages: pipeline stages in all (``pp * virtual``); tags are unique per message of a step.
        pp: pipeline ranks; stage ``g`` lives on pp rank ``g % pp``.
        stage_rank: pp rank -> global rank.
        device: where receive buffers are allocated.
    """

    def __init__(self, group: Optional[ProcessGroup], *, stages: int, pp: int, stage_rank: Callable[[int], int],
                 device: torch.device) -> None:
        self.group, self.stages, self.pp, self.stage_rank, self.device = group, stages, pp, stage_rank, device
        self.last_rank = stage_rank((stages - 1) % pp)
        self.early = dist.get_backend(group) != "nccl"  # see the module docstring
        self.waited = 0.0  # seconds spent waiting for receives since the caller last reset it
        self.sent = 0.0  # seconds spent sending (posting, and waiting for completion in flush), likewise
        self.blocked: Optional[Blocked] = None  # the message a wait is blocked on now (the hang report reads it)
        self.spans: Optional[list[CommSpan]] = None  # sends and blocking receives, while a timeline records
        self._sends: list[tuple[Any, Message, int]] = []  # pending sends: work, message, destination rank
        self._headers: dict[tuple[int, int, int], Posted] = {}  # (mb, src, dst) -> posted header receive
        self._rank = dist.get_rank()
        self._mailbox: dict[int, Tensor] = {}  # tag -> a message from one of this rank's stages to another

    def tag(self, mb: int, src: int, dst: int, kind: int, leaf: int = 0) -> int:
        """Unique per message of a step; both ends derive it from the stages (with interleaving a rank holds several,
        and one stage may feed several later ones)."""
        return (((mb * self.stages + src) * self.stages + dst) * 3 + kind) * _MAX_LEAVES + leaf

    def rank_of_stage(self, stage: int) -> int:
        return self.stage_rank(stage % self.pp)

    def _isend(self, t: Tensor, dst: int, tag: int, message: Message) -> None:
        if dst == self._rank:  # kept, as an isend's buffer is, until the receiving stage takes it
            self._mailbox[tag] = t
            return
        self._sends.append((dist.isend(t.contiguous(), dst, tag=tag), message, dst))

    def _sending(self, message: Message, peer: int, start: float) -> None:
        """Account for a send that began at ``start`` (posting it, or waiting for it to complete)."""
        end = time.perf_counter()
        self.sent += end - start
        if self.spans is not None:
            self.spans.append(("send", message, peer, start, end))

    def post(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> Posted:
        """Post a receive now (so that the transfer can happen while this rank computes); wait for it later."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        if src == self._rank:
            return buf, _Delivery(self._mailbox, tag, buf)
        return buf, dist.irecv(buf, src, tag=tag)

    def wait(self, posted: list[Posted], message: Message) -> list[Tensor]:
        """Block until the posted receives of ``message`` complete."""
        start = time.perf_counter()
        peer = self.rank_of_stage(message[2])
        self.blocked = ("receive", message, peer, start, None)
        try:
            for _, work in posted:
                work.wait()
        except BaseException:
            self.blocked = ("receive", message, peer, start, time.perf_counter())
            raise
        self.blocked = None
        end = time.perf_counter()
        self.waited += end - start
        if self.spans is not None:
            self.spans.append(("receive", message, peer, start, end))
        return [buf for buf, _ in posted]

    def describe_blocked(self) -> str:
        """The message a wait is blocked on now (or was, when the wait raised), in words, or ``''``."""
        blocked = self.blocked
        if blocked is None:
            return ""
        direction, (what, mb, src, dst), peer, since, until = blocked
        took = (time.perf_counter() if until is None else until) - since
        ended = "" if until is None else ", until the wait raised"
        if direction == "receive":
            return (f"waiting {took:.1f} s to receive the {what} of micro-batch {mb} from stage {src} (rank {peer}) "
                    f"for stage {dst}{ended}")
        return (f"waiting {took:.1f} s for the send of the {what} of micro-batch {mb} from stage {src} to stage {dst} "
                f"(rank {peer}) to complete{ended}")

    def post_headers(self, inbound: dict[int, dict[int, int]], microbatches: int) -> None:
        """Every header this rank will receive in the step (``inbound``: local stage -> {source stage: tensors}),
        posted up front: a bundle then costs one round trip."""
        for mb in range(microbatches if self.early else 0):
            for g, sources in inbound.items():
                for src, count in sources.items():
                    self._headers[(mb, src, g)] = self.post((count * _HEADER,), torch.int64,
                                                            self.rank_of_stage(src), self.tag(mb, src, g, 0))

    def send_bundle(self, mb: int, src: int, dst: int, tensors: list[Tensor]) -> None:
        if len(tensors) > _MAX_LEAVES:
            raise PipelineError(f"{len(tensors)} tensors cross from pipeline stage {src} to {dst}; at most "
                                f"{_MAX_LEAVES} are supported")
        start, message = time.perf_counter(), ("activations", mb, src, dst)
        header = torch.zeros(len(tensors) * _HEADER, dtype=torch.int64, device=self.device)
        for i, t in enumerate(tensors):
            if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
                raise PipelineError(f"cannot send a {t.dim()}-d {t.dtype} activation between stages")
            row = [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
            header[i * _HEADER:i * _HEADER + len(row)] = torch.tensor(row)
        rank = self.rank_of_stage(dst)
        self._isend(header, rank, self.tag(mb, src, dst, 0), message)
        for i, t in enumerate(tensors):
            self._isend(t.detach(), rank, self.tag(mb, src, dst, 1, i), message)
        self._sending(message, rank, start)

    def receive_bundle(self, mb: int, src: int, dst: int, count: int) -> list[Tensor]:
        """The ``count`` tensors stage ``src`` sends stage ``dst``; those sent requiring grad come as graph leaves."""
        rank = self.rank_of_stage(src)
        posted = self._headers.pop((mb, src, dst), None) or self.post(
            (count * _HEADER,), torch.int64, rank, self.tag(mb, src, dst, 0))
        message = ("activations", mb, src, dst)
        header = self.wait([posted], message)[0].tolist()
        rows = [header[k * _HEADER:(k + 1) * _HEADER] for k in range(count)]
        out = self.wait([self.post(tuple(dims[:ndim]), _DTYPES[code], rank, self.tag(mb, src, dst, 1, k))
                         for k, (code, _, ndim, *dims) in enumerate(rows)], message)
        return [t.requires_grad_(True) if row[1] else t for t, row in zip(out, rows)]

    def post_grads(self, mb: int, stage: int, dst: int, sent: list[Tensor]) -> list[Posted]:
        """Receives of the gradients stage ``dst`` returns for what ``stage`` sent it (those requiring grad)."""
        rank = self.rank_of_stage(dst)
        return [self.post(tuple(t.shape), t.dtype, rank, self.tag(mb, dst, stage, 2, i))
                for i, t in enumerate(x for x in sent if x.requires_grad)]

    def send_grads(self, mb: int, stage: int, src: int, received: list[Tensor],
                   grads: dict[int, Optional[Tensor]]) -> None:
        """Return to stage ``src`` the gradients (by tensor id; zeros where none) of what ``stage`` received."""
        start, message, rank = time.perf_counter(), ("gradients", mb, stage, src), self.rank_of_stage(src)
        for i, t in enumerate(x for x in received if x.requires_grad):
            grad = grads.get(id(t))
            self._isend(grad if grad is not None else torch.zeros_like(t), rank, self.tag(mb, stage, src, 2, i),
                        message)
        self._sending(message, rank, start)

    def flush(self) -> None:
        """Wait for this step's sends (their buffers must live until then)."""
        for work, message, peer in self._sends:
            start = time.perf_counter()
            self.blocked = ("send", message, peer, start, None)
            try:
                work.wait()
            except BaseException:
                self.blocked = ("send", message, peer, start, time.perf_counter())
                raise
            self.blocked = None
            self._sending(message, peer, start)
        self._sends = []
        self._mailbox.clear()

    def agree(self, digest: str, what: str) -> None:
        """Every rank of the pipeline must have traced the same forward; a mismatch would hang at the first send."""
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, digest, group=self.group)
        if any(d != digest for d in every):
            raise PipelineError(f"the pipeline stages traced different forwards for one {what} step (the forward "
                                f"takes a different path on some ranks); it must call the same layers everywhere")

    def broadcast_from_last(self, value: Tensor) -> Tensor:
        """The last stage's scalar (the loss) on every rank of the pipeline."""
        value = value.detach().float().reshape(()).contiguous()
        dist.broadcast(value, src=self.last_rank, group=self.group)
        return value

    def broadcast_object_from_last(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]
