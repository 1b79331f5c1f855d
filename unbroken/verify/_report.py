"""The verdict of ``unbroken verify``: what was run, what differs, and the likely causes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ._compare import Comparison, Difference, FirstDifferences


@dataclass(slots=True)
class Interruption:
    """One interruption of the second run."""

    launch: int
    """Which launch of the interrupted run it ended (1-based)."""
    signal: str
    """``SIGKILL`` or ``SIGTERM``."""
    moment: str
    """What it waited for: ``step 7`` or ``save of step 8``."""
    at_step: int
    """The last step the run had logged when it ended."""
    exit_code: int
    """The launch's exit code (negative: killed by that signal number; 75: saved and stopped)."""
    during_save: bool
    """A save was in progress when it died (its ``.tmp-step-*`` directory was left behind)."""


@dataclass(slots=True)
class VerifyReport(FirstDifferences):
    """The result of :func:`unbroken.verify_resume` (``unbroken verify``)."""

    passed: bool
    command: list[str]
    seed: int
    reference_steps: int
    """Steps of the uninterrupted run."""
    checkpoints_compared: list[int]
    """Checkpoint steps compared, tensor by tensor."""
    metrics_compared: int
    """Step records of the metrics log compared."""
    interruptions: list[Interruption] = field(default_factory=list)
    launches: int = 0
    """Processes started for the interrupted run (interruptions + 1 when all went as planned)."""
    resumed_from: list[int] = field(default_factory=list)
    """The checkpoint step each relaunch resumed from (0: started afresh)."""
    differences: list[Difference] = field(default_factory=list)
    """The first difference of each component and metric, earliest first."""
    hints: list[str] = field(default_factory=list)
    """Likely causes, most likely first."""
    work_dir: str | None = None
    """Where the two run directories are (None once removed after a pass)."""
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``unbroken verify --json`` prints)."""
        first = self.first_difference
        metric = self.first_metric_difference
        return {
            "passed": self.passed,
            "command": list(self.command),
            "seed": self.seed,
            "reference_steps": self.reference_steps,
            "checkpoints_compared": list(self.checkpoints_compared),
            "metrics_compared": self.metrics_compared,
            "launches": self.launches,
            "interruptions": [asdict(i) for i in self.interruptions],
            "resumed_from": list(self.resumed_from),
            "first_difference": first.as_dict() if first else None,
            "first_metric_difference": metric.as_dict() if metric else None,
            "differences": [d.as_dict() for d in self.differences],
            "hints": list(self.hints),
            "work_dir": self.work_dir,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """The human-readable report (what ``unbroken verify`` prints)."""
        kills = [i for i in self.interruptions if i.exit_code != 0]  # not those too late
        how = ", ".join(f"{i.signal} at {i.moment}" for i in kills) or "none"
        saves = sum(i.during_save for i in kills)
        lines = []
        if self.passed:
            lines.append(
                f"PASS: the interrupted run equals the uninterrupted one "
                f"({self.reference_steps} steps)"
            )
        else:
            first = self.first_difference
            assert first is not None
            lines.append(f"FAIL: {first.describe()}")
        lines.append(
            f"  interruptions: {len(kills)} ({how}); {saves} during a save; "
            f"{self.launches} launches; resumed from "
            + (", ".join(map(str, self.resumed_from)) or "-")
        )
        steps = ", ".join(map(str, self.checkpoints_compared)) or "none"
        lines.append(
            f"  compared: checkpoints at steps {steps} (every tensor and all state), "
            f"{self.metrics_compared} logged steps"
        )
        if self.differences:
            lines.append("  differs (first step, first key, reference vs interrupted):")
            for d in self.differences:
                what = (
                    f"max |Δ| {d.max_abs_diff:.3g}"
                    if d.max_abs_diff is not None
                    else f"{d.reference} vs {d.other}"
                )
                lines.append(f"    step {d.step:<6} {d.where:<40} {what}")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.hints:
            lines.append("hints:")
            lines.extend(f"  - {h}" for h in self.hints)
        if self.work_dir:
            lines.append(f"run directories kept in {self.work_dir} (reference/, interrupted/)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


NONDET = (
    "The runs already differ before the first resume took effect (step {resume}): this is not a "
    "resume problem, the script does not repeat itself from launch to launch. Look for unseeded "
    "randomness (a random.Random(), numpy.random.default_rng() or sampler seeded from the OS or "
    "the clock; global streams not seeded at start: call unbroken.seed_everything(seed) before "
    "building the model and data) and nondeterministic ops "
    "(torch.use_deterministic_algorithms(True)). `--interrupts 0` shows the same."
)
UNSEEDED_GLOBAL = (
    "Python's or NumPy's global random stream differs from the start: the script does not seed "
    "it. Call unbroken.seed_everything(seed) first (or pass seed= to Run); if the script never "
    "uses that stream, ignore it: --ignore rng.python --ignore rng.numpy."
)
LOADER = (
    "No resumable data loader is tracked. A plain torch.utils.data.DataLoader (or a sampler "
    "shuffling with its own random.Random or torch.Generator) is not resumable: a relaunch "
    "starts the epoch over and reshuffles, so the resumed run trains on other batches. Use "
    "unbroken.DataLoader(dataset, ..., seed=...) and pass it to Run (loader=loader)."
)
LOADER_STATE = (
    "The tracked loader's position ({name}) differs: the batch size or the batches drawn per "
    "step depend on something not restored; a batch-size schedule must be a pure function of "
    "the step."
)
LR = (
    "The learning rate differs after a resume: an LR scheduler that is not passed to Run starts "
    "over when relaunched. Track it (Run(..., scheduler=sched)) or compute the LR as a pure "
    "function of run.counters.step."
)
LR_TRACKED = (
    "The learning rate differs after a resume although a scheduler ({name}) is tracked: another "
    "scheduler, or an LR computed from a counter of the script, is not restored; schedules must "
    "be pure functions of the step."
)
RNG = (
    "The global random streams (component 'rng') differ after a resume: a relaunched process "
    "draws from them a different number of times, e.g. a plain torch DataLoader draws a seed "
    "for every new iterator, or the script draws random numbers after Run(...) restored the "
    "streams; build everything random before creating the Run."
)
GENERATOR = (
    "An untracked random generator: a torch.Generator, random.Random, numpy Generator or "
    "numpy RandomState used for noise, augmentation or dropout masks restarts from its seed "
    "after a relaunch unless it is passed to Run as a component (Run(..., noise=gen)); "
    "per-sample randomness can come from unbroken.DataLoader's per-sample generator "
    "(dataset.get_sample(i, generator))."
)
COMPONENT = (
    "A stateful object not passed to Run (an LR scheduler, GradScaler, EMA, a custom object with "
    "state_dict()/load_state_dict()) starts afresh after a relaunch; track every one."
)
HIDDEN_GENERIC = (
    "A module keeps state outside its state_dict (a tensor attribute or a non-persistent buffer "
    "updated in forward, a Python counter): it is not saved, so a resume restarts it; register "
    "it as a persistent buffer (self.register_buffer(name, tensor))."
)
NONDET_OPS = (
    "Nondeterministic ops (CUDA atomics, some scatter/index ops) make even uninterrupted runs "
    "differ: check with --interrupts 0, set torch.use_deterministic_algorithms(True), or "
    "compare with --atol/--rtol."
)
METRICS_ONLY = (
    "Only the metrics log differs: a logged value depends on something not saved (wall time, a "
    "counter kept in the script). If that is expected, --ignore metrics.KEY."
)
UNTRACKED_PARAM = (
    "An untracked parameter: optimizer {name!r} updates {keys} that no tracked module owns "
    "(saved as '#<position>': the moments are saved, the value nowhere), so a resume restarts "
    "them from their initial values. Pass the module that owns them to Run, or hold them in a "
    "module you pass (torch.nn.ParameterDict); Run warned about it at start-up."
)
UNTRACKED_OPTIMIZER = (
    "An untracked optimizer: {optimizer} updates {modules} but is not passed to Run (Run "
    "warned about it at its first step), so its moments and step count start afresh after a "
    "relaunch. Create it before the Run and pass it: Run(..., optimizer=opt)."
)
RNG_AFTER_RUN = (
    "Random draws between Run() and the loop: {streams} advanced after Run() had restored the "
    "streams (Run warned about it with a ResumeWarning), so a resumed run draws at other "
    "positions than an uninterrupted one. Draw them before creating the Run (fixed evaluation "
    "inputs, say), or from a separate torch.Generator()."
)
HIDDEN_STATE = (
    "Module state outside the state_dict: {names} changed during training but is not saved "
    "(Run warned about it at start-up), so a resume restarts it. Register it as a persistent "
    "buffer (self.register_buffer(name, tensor))."
)
CALLBACK = (
    "What a callback returned differs ({where}): before_step or on_epoch_start keeps state of its "
    "own (a counter or a flag in a closure or a global), which a relaunch resets. Decide from "
    "ctx.step, ctx.epoch and ctx.stage, which are restored, or keep that state in a component "
    "passed to Run."
)
SKIPPED = (
    "The optimizer took a different number of steps ({where}): the runs skipped different steps, "
    "as torch.amp.GradScaler does on inf/NaN gradients. A GradScaler not passed to Run restarts "
    "its scale after a relaunch; track it (Run(..., scaler=scaler))."
)
EMA_METRIC = (
    "A value logged from averaged weights ({key}) differs while every tracked state agrees: an "
    "EMA (unbroken.EMA, torch.optim.swa_utils.AveragedModel) not passed to Run restarts after a "
    "relaunch; track it (Run(..., ema=ema))."
)


def hints_for(cmp: Comparison, resumed_from: list[int]) -> list[str]:
    """Likely causes of the differences, the best evidenced first.

    Evidence, strongest first: the runs differ before any resume (not a resume problem); what
    the Run's start-up audit recorded (draws after Run(), module state outside the
    state_dict); a callback's saved overrides; parameters no tracked module owns; no tracked
    loader; the learning rate; the loader's position; the optimizer's step count; the random
    streams; then the usual suspects of a model that diverges.
    """
    if cmp.passed:
        return []
    diffs = cmp.differences
    first = diffs[0]
    hints: list[str] = []
    resumes = [r for r in resumed_from if r > 0]
    first_resume = min(resumes) if resumes else None
    if first_resume is None or first.step <= first_resume:
        hints.append(NONDET.format(resume=first_resume if first_resume is not None else "-"))
        early_rng = [
            d for d in diffs if d.component == "rng" and d.key.split(".")[0] in {"python", "numpy"}
        ]
        if early_rng and early_rng[0].step <= (first_resume or early_rng[0].step):
            hints.append(UNSEEDED_GLOBAL)
    state = [d for d in diffs if d.component != "metrics"]
    at_first = [d for d in state if d.step == state[0].step] if state else []
    kind = {d.component: cmp.kinds.get(d.component.split("@")[0], "stateful") for d in state}
    for event in cmp.audit:
        if event.get("check") == "untracked_optimizer":
            modules = ", ".join(repr(m) for m in event.get("modules", []))
            hints.append(
                UNTRACKED_OPTIMIZER.format(optimizer=event.get("optimizer"), modules=modules)
            )
        elif event.get("check") == "rng_after_run":
            hints.append(RNG_AFTER_RUN.format(streams=" and ".join(event.get("streams", []))))
        elif event.get("check") == "hidden_state":
            hints.append(HIDDEN_STATE.format(names=", ".join(event.get("names", []))))
    for d in state:
        if kind[d.component] == "counters" and d.key.split(".")[0] in ("overrides", "stage"):
            hints.append(CALLBACK.format(where=d.where))
    trained = any(kind[d.component] in ("module", "optimizer") for d in state)
    for name, keys in cmp.untracked_params.items():
        if trained or any(d.component == "metrics" for d in diffs):
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            hints.append(UNTRACKED_PARAM.format(name=name, keys=shown))
    loaders = [n for n, k in cmp.kinds.items() if k == "loader"]
    lr_diff = any(_is_lr(d) for d in diffs if d.step <= (state[0].step if state else d.step))
    if not loaders and cmp.kinds:
        hints.append(LOADER)
    if lr_diff:
        hints.append(LR_TRACKED.format(name=cmp.schedulers[0]) if cmp.schedulers else LR)
    for d in at_first:
        if d.component in loaders:
            hints.append(LOADER_STATE.format(name=d.component))
    skipped = [
        d.where for d in state if kind[d.component] == "optimizer" and d.key.endswith(".step")
    ]
    hints += [SKIPPED.format(where=where) for where in [*skipped, *cmp.step_counts][:1]]
    if any(d.component.split("@")[0] == "rng" for d in at_first) and UNSEEDED_GLOBAL not in hints:
        hints.append(RNG)
    if not state:
        hints += [EMA_METRIC.format(key=d.key) for d in diffs if "ema" in d.key.lower()][:1]
        hints.append(METRICS_ONLY)
    else:
        hints += [GENERATOR, COMPONENT, HIDDEN_GENERIC, NONDET_OPS]
    return list(dict.fromkeys(hints))


def _is_lr(d: Difference) -> bool:
    if d.component == "metrics":
        key = d.key.lower().replace("-", "_")
        return "lr" in key.split("_") or "learning_rate" in key
    return bool({"lr", "initial_lr", "_last_lr"} & set(d.key.split(".")))
