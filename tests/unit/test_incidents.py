"""The spike guard's pure parts in one process: the detector on realistic noisy curves (a healthy run of a few
hundred steps never fires with the defaults; planted spikes do), the incident budget, host snapshots, the incident
record, the guard's argument errors, a LightningCLI config, and the whole guard in a one-process run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

from lightning_tpp import SpikeGuard, TooManyIncidentsError
from lightning_tpp.incidents import (Incident, IncidentBudget, IncidentLog, SpikeDetector, read_incidents,
                                     restore_snapshot, take_snapshot)
from models import LitLM, token_dataset

STEPS = 500


def _curves(seed: int, kind: str) -> tuple[list[float], list[float]]:
    """A training run's loss and gradient norm, step by step: a decaying loss with multiplicative noise (Gaussian,
    or Student-t with 5 degrees of freedom: heavy tails), a gradient norm that ramps up under LR warmup and then
    wanders with log-normal noise; or a plateau whose loss barely moves (a tiny standard deviation)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(STEPS, dtype=torch.float64)
    if kind == "plateau":
        loss = 2.0 + 1e-4 * torch.randn(STEPS, generator=g, dtype=torch.float64)
    else:
        base = 2.0 + 8.0 * torch.exp(-t / 60)
        if kind == "gaussian":
            noise = 0.05 * torch.randn(STEPS, generator=g, dtype=torch.float64)
        else:  # Student-t, 5 degrees of freedom, scale 0.03: now and then a batch 20-40% off
            z = torch.randn(STEPS, generator=g, dtype=torch.float64)
            chi = sum(torch.randn(STEPS, generator=g, dtype=torch.float64) ** 2 for _ in range(5))
            noise = 0.03 * z / torch.sqrt(chi / 5)
        loss = base * (1 + noise)
    warm = torch.clamp(t / 100, max=1.0)
    sigma = 0.4 if kind == "student" else 0.3
    norm = (0.3 + 1.7 * warm) * torch.exp(sigma * torch.randn(STEPS, generator=g, dtype=torch.float64))
    return loss.tolist(), norm.tolist()


@pytest.mark.parametrize("kind", ["gaussian", "student", "plateau"])
def test_defaults_never_fire_on_a_healthy_run(kind: str) -> None:
    fired = []
    for seed in range(20):
        detector = SpikeDetector()
        loss, norm = _curves(seed, kind)
        for step, (lv, nv) in enumerate(zip(loss, norm)):
            for trigger in detector.check({"loss": lv, "grad_norm": nv}):
                fired.append((seed, step, trigger))
    assert not fired, fired[:5]


@pytest.mark.parametrize(("signal", "factor"), [("loss", 3.0), ("grad_norm", 20.0), ("loss", math.nan),
                                                 ("grad_norm", math.inf)])
def test_planted_spikes_fire(signal: str, factor: float) -> None:
    detector = SpikeDetector()
    loss, norm = _curves(0, "student")
    fired = []
    for step, (lv, nv) in enumerate(zip(loss, norm)):
        values = {"loss": lv, "grad_norm": nv}
        if step in (250, 400):
            values[signal] *= factor
        fired += [(step, t.signal) for t in detector.check(values)]
    assert fired == [(250, signal), (400, signal)]


def test_window_warmup_and_spikes_kept_out() -> None:
    detector = SpikeDetector(window=4, warmup=3, z_threshold=3.0, ratios={"loss": 1.5, "grad_norm": None})
    assert detector.check({"loss": 100.0, "grad_norm": 1e9}) == []  # warming up; grad norm not watched
    assert detector.check({"loss": 1.0}) == [] and detector.check({"loss": 1.0}) == []
    mean = sum([100.0, 1.0, 1.0]) / 3
    assert detector.windows["loss"].stats()[0] == pytest.approx(mean)
    detector.check({"loss": 1.0})
    detector.check({"loss": 1.0})  # the window of 4 forgot the 100
    trigger, = detector.check({"loss": 10.0})
    assert (trigger.signal, trigger.value, trigger.mean, trigger.ratio) == ("loss", 10.0, 1.0, 10.0)
    assert list(detector.windows["loss"].values) == [1.0] * 4  # the spike did not join the window


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(window=1), r"window=1 must be an integer >= 2"),
    (dict(warmup=0), r"warmup=0 must be an integer in \[1, window=100\]"),
    (dict(warmup=200), r"warmup=200 must be an integer in \[1, window=100\]"),
    (dict(z_threshold=0), r"z_threshold=0 must be > 0"),
    (dict(loss_ratio=0.9), r"loss_ratio=0.9 must be > 1 \(times the running mean\), or None to not watch the loss"),
    (dict(grad_norm_ratio=1), r"grad_norm_ratio=1 must be > 1"),
    (dict(action="restart"), r"action='restart' must be 'skip' .* or 'rollback'"),
    (dict(snapshot_every_n_steps=0), r"snapshot_every_n_steps=0 must be a positive integer"),
    (dict(rollback_lr_factor=2.0), r"rollback_lr_factor=2.0 must be in \(0, 1\] and rollback_lr_steps=0 a "
                                   r"non-negative integer, e.g. rollback_lr_factor=0.5"),
    (dict(rollback_lr_steps=-1), r"rollback_lr_steps=-1 a non-negative integer"),
    (dict(max_incidents=-1), r"max_incidents=-1 must be an integer >= 0"),
    (dict(incident_window=0), r"incident_window=0 must be a positive number of steps"),
])
def test_guard_argument_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpikeGuard(**kwargs)


def test_budget_stops_listing_the_incidents() -> None:
    budget = IncidentBudget(limit=2, within=100)
    budget.add(10, "spike a")
    budget.add(50, "spike b")
    budget.add(200, "spike c")  # 10 and 50 are out of the window by now
    budget.add(250, "spike d")
    with pytest.raises(TooManyIncidentsError, match=r"3 incidents within 100 steps \(max_incidents=2\); stopping:\n"
                                                    r"  step 200: spike c\n  step 250: spike d\n  step 260: spike e"
                                                    r"\n.*raise SpikeGuard\(max_incidents=...\)"):
        budget.add(260, "spike e")


def test_snapshot_restores_parameters_optimizer_schedule_rng() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step() -> None:
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    step()
    snap = take_snapshot(model, [opt], [sched], step=1, counters={"global_step": 1})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    lr, after = opt.param_groups[0]["lr"], torch.rand(3)
    torch.manual_seed(123)  # any RNG position: the snapshot's comes back
    snap_rng = snap.rng["torch"]
    for _ in range(3):
        step()
    restore_snapshot(snap, model, [opt], [sched])
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    for p, s in opt.state.items():
        for k, v in s.items():
            torch.testing.assert_close(v, moments[id(p)][k], rtol=0, atol=0)
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 1
    assert bytes(torch.get_rng_state().numpy()) == snap_rng
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert snap.nbytes == params + buffers + 2 * params + 4 * len(list(model.parameters()))  # Adam: m, v, step
    assert after.shape == (3,)


def test_snapshot_refuses_another_model() -> None:
    model = torch.nn.Linear(2, 2)
    snap = take_snapshot(model, [], [], step=0, counters={})
    with pytest.raises(ValueError, match=r"the snapshot of step 0 holds 2 parameters and 0 optimizer\(s\), the "
                                         r"model now 4 and 0"):
        restore_snapshot(snap, torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), [], [])


def test_record_jsonl_and_loggers(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="run", version=0)
    log = IncidentLog()
    log.open(str(tmp_path / "run"), writer=True)
    log.add(Incident(7, "spike", "skip", {"loss": 9.5, "loss_z": math.inf}, [1]), [logger])
    log.add(Incident(9, "nonfinite", "skip", {"loss": math.nan}, [0, 1]), [logger])
    logger.save()
    lines = read_incidents(tmp_path / "run" / "incidents.jsonl")
    assert [(d["step"], d["kind"], d["action"], d["ranks"]) for d in lines] == [(7, "spike", "skip", [1]),
                                                                                 (9, "nonfinite", "skip", [0, 1])]
    assert lines[0]["values"]["loss_z"] == math.inf and math.isnan(lines[1]["values"]["loss"])
    raw = (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()
    assert json.loads(raw[1])["values"] == {"loss": "nan"}  # strict JSON: no NaN literal
    metrics = (tmp_path / "run" / "version_0" / "metrics.csv").read_text()
    assert "incidents/spike" in metrics and "incidents/loss" in metrics and "incidents/count" in metrics
    other = IncidentLog()  # not rank 0: keeps its own list, writes nothing
    other.open(str(tmp_path / "other"), writer=False)
    other.add(Incident(1, "spike", "skip", {}, [0]))
    assert len(other.incidents) == 1 and not (tmp_path / "other").exists()


def test_cli_config(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("""
trainer:
  accelerator: cpu
  logger: false
  callbacks:
    - class_path: lightning_tpp.SpikeGuard
      init_args:
        action: rollback
        snapshot_every_n_steps: 200
        rollback_lr_factor: 0.5
        rollback_lr_steps: 100
""")
    cli = LightningCLI(LitLM, run=False, args=[f"--config={config}"])
    guard, = [c for c in cli.trainer.callbacks if isinstance(c, SpikeGuard)]
    assert (guard.action, guard.every, guard.lr_factor, guard.lr_steps) == ("rollback", 200, 0.5, 100)


class _Planted(LitLM):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        return loss * 1000.0 if batch_idx in (4, 6) else loss


def _fit(tmp_path: Path, guard: SpikeGuard, module: L.LightningModule) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=CSVLogger(tmp_path, name="g", version=0),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[guard])
    trainer.fit(module, torch.utils.data.DataLoader(token_dataset(32), batch_size=4))
    return trainer


def test_too_many_incidents_stop_the_run(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    guard = SpikeGuard(warmup=3, max_incidents=1)
    with pytest.raises(TooManyIncidentsError, match=r"2 incidents within 1000 steps \(max_incidents=1\); stopping:\n"
                                                    r"  step 4: spike \(loss=.*\) on ranks \[0\] -> skip\n  step 6: "):
        _fit(tmp_path, guard, _Planted("nanogpt4", lr=0.05))
    lines = read_incidents(tmp_path / "g" / "version_0" / "incidents.jsonl")
    assert [(d["step"], d["action"]) for d in lines] == [(4, "skip"), (6, "stop")]  # the step counts skipped ones


def test_manual_optimization_is_refused(tmp_path: Path) -> None:
    class Manual(LitLM):
        def __init__(self) -> None:
            super().__init__("nanogpt4")
            self.automatic_optimization = False

    with pytest.raises(ValueError, match=re.escape("SpikeGuard needs automatic optimization")):
        _fit(tmp_path, SpikeGuard(), Manual())


def test_memory_planner_counts_the_snapshot() -> None:
    """``estimate_memory(snapshot=True)``: each rank's host copy is its parameters + optimizer state, what a real
    snapshot of the same model and optimizer holds (buffers aside, which the planner does not count)."""
    from lightning_tpp import estimate_memory
    from models import MODELS

    torch.manual_seed(0)
    model = MODELS["nanogpt4"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randint(0, 16, (2, 8))).sum().backward()
    opt.step()
    real = take_snapshot(model, [opt], [], step=1, counters={})
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    plain = estimate_memory(model, tp=1, pp=1, batch_size=2, seq_len=8, optimizer="sgd-momentum")
    kept = estimate_memory(model, tp=1, pp=1, batch_size=2, seq_len=8, optimizer="sgd-momentum", snapshot=True)
    assert plain.ranks[0].snapshot == 0 and "SpikeGuard" not in str(plain)
    assert kept.ranks[0].snapshot == real.nbytes - buffers
    assert kept.ranks[0].total == plain.ranks[0].total  # host memory: not the device's
    assert "host memory for SpikeGuard's snapshot" in str(kept)
    cut = estimate_memory(model, tp=2, pp=2, batch_size=4, seq_len=8, optimizer="adamw", snapshot=True)
    for r in cut.ranks:  # each rank copies only its own shards
        assert r.snapshot == r.params + r.optimizer and r.snapshot < kept.ranks[0].snapshot


def test_guard_state_survives_a_checkpoint(tmp_path: Path) -> None:
    """The windows and the incident budget are plain values: saved in the checkpoint, loaded with weights_only."""
    guard = SpikeGuard(warmup=2)
    for v in (1.0, 1.1, 0.9):
        guard.detector.check({"loss": v, "grad_norm": 2 * v})
    guard.budget.add(2, "spike x")
    torch.save(guard.state_dict(), tmp_path / "state.pt")
    resumed = SpikeGuard(warmup=2)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    resumed._reset_run()  # a new fit: the checkpoint's windows are kept
    assert list(resumed.detector.windows["loss"].values) == [1.0, 1.1, 0.9]
    assert list(resumed.detector.windows["grad_norm"].values) == [2.0, 2.2, 1.8]
    assert resumed.budget.steps == [(2, "spike x")]
    assert resumed.detector.check({"loss": 10.0, "grad_norm": 2.0})[0].signal == "loss"


def test_snapshot_before_the_first_step_forgets_later_optimizer_state() -> None:
    """The snapshot taken when training starts has no optimizer state yet: restoring it removes what came since."""
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    snap = take_snapshot(model, [opt], [], step=0, counters={})
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert len(opt.state) == 2
    restore_snapshot(snap, model, [opt], [])
    assert len(opt.state) == 0
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)


def test_nonfinite_raise_is_recorded(tmp_path: Path) -> None:
    """``on_nonfinite="raise"`` stops every rank with ``NonFiniteLossError``; the guard writes it down first."""
    from lightning_tpp.reliability.nonfinite import NonFiniteLossError

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="r", version=0))
    guard = SpikeGuard()
    guard.incident_log.open(str(tmp_path / "r"), writer=True)
    error = NonFiniteLossError("non-finite loss at step 2 on ranks [1, 3] (on_nonfinite='raise'); pass ...")
    guard.on_exception(trainer, LitLM("nanogpt4"), error)
    line, = read_incidents(tmp_path / "r" / "incidents.jsonl")
    assert (line["kind"], line["action"], line["ranks"]) == ("nonfinite", "raise", [1, 3])


def test_snapshot_refuses_a_cleared_optimizer() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    snap = take_snapshot(model, [opt], [], step=1, counters={})
    opt.state.clear()
    with pytest.raises(ValueError, match=re.escape("SGD's state of parameter 0 (shape (2, 2), keys "
                                                   "['momentum_buffer'] at the snapshot) is gone: the optimizer was "
                                                   "replaced or its state cleared since")):
        restore_snapshot(snap, model, [opt], [])
