"""Values that a unit's layers hand out beside its outputs: transformers records router logits (for the
load-balancing loss), attentions and hidden states with forward hooks inside the layers, into a collector that the
model reads after its last layer. Under a pipeline a unit runs on one stage only, so what its hooks recorded travels
as extra outputs of the unit::

    owner stage:    run the unit, keep what its layers appended   -> (output, [(key, value), ...]) routed as outputs
    other stages:   the meta twin (hooked alike) gives the shapes  -> received values appended under the same keys

The last stage's collector then holds every layer's values in order, differentiable back to the stage that computed
them. Hooks on the unit module itself (a decoder layer's hidden state) are not captured this way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from torch import Tensor, nn

from lightning_tpp._compat import hf_install_output_hook, hf_output_collector, is_hf_pretrained

Recorded = list[tuple[str, Any]]  # (collector key, value) in the order the hooks appended them


@contextlib.contextmanager
def recorded(*, remove: bool = False) -> Iterator[Recorded]:
    """What hooks append to the active collector inside the block (``remove``: taken out again, e.g. a meta twin's)."""
    collector = hf_output_collector()
    items: Recorded = []
    if collector is None:
        yield items
        return
    before = {k: len(v) for k, v in collector.items() if isinstance(v, list)}
    try:
        yield items
    finally:
        for key, start in before.items():
            new = collector[key][start:]
            items.extend((key, v) for v in new)
            if remove:
                del collector[key][start:]


def replay(items: Recorded) -> None:
    """Append values received for another stage's unit where its hooks would have put them."""
    collector = hf_output_collector()
    if collector is None:
        return
    for key, value in items:
        if key in collector and isinstance(collector[key], list):
            collector[key].append(value)


def hook_twins(root: nn.Module, twins: dict[str, nn.Module]) -> None:
    """Give each unit's meta twin the recording hooks its layers get in the real model (by class, as transformers
    installs them), so that a twin's run on the meta device shows what the unit's layers record."""
    owners = sorted(((n, m) for n, m in root.named_modules() if is_hf_pretrained(m)), key=lambda nm: -len(nm[0]))
    for unit, twin in twins.items():
        owner = next((m for n, m in owners if not n or unit.startswith(f"{n}.")), None)
        for key, recorder in _recorders(owner):
            if key == "hidden_states":  # recorded by the unit itself, outside its forward
                continue
            for name, sub in twin.named_modules():
                if name and _matches(recorder, sub, f"{unit}.{name}"):
                    hf_install_output_hook(sub, key, recorder)


def _recorders(model: Optional[nn.Module]) -> list[tuple[str, Any]]:
    flags = getattr(type(model), "_can_record_outputs", None) if model is not None else None
    out = []
    for key, specs in (flags or {}).items():
        for spec in specs if isinstance(specs, list) else [specs]:
            if hasattr(spec, "target_class") and hasattr(spec, "index"):  # an OutputRecorder
                out.append((key, spec))
            elif isinstance(spec, type):
                out.append((key, _Recorder(spec, 0 if "hidden_states" in key else 1)))
    return out


class _Recorder:
    def __init__(self, target_class: type, index: int) -> None:
        self.target_class, self.index, self.layer_name, self.class_name = target_class, index, None, None
        self.capture_initial_hidden_state = True


def _matches(recorder: Any, module: nn.Module, name: str) -> bool:
    target = getattr(recorder, "target_class", None)
    if not ((target is not None and isinstance(module, target))
            or (recorder.class_name is not None and name.endswith(recorder.class_name))):
        return False
    layer = getattr(recorder, "layer_name", None)
    return layer is None or f".{layer.strip('.')}." in f".{name}."


def tensors(items: Recorded) -> list[Tensor]:
    return [v for _, v in items if isinstance(v, Tensor)]
