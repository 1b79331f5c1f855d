"""The verdict of ``unbroken verify``: what was run, what differs, and the likely causes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ._findings import Comparison, Difference, FirstDifferences
from ._volatile import NotCompared, listing


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
    process: str = "process"
    """How the launch it ended had started: ``process`` (the command, a new process) or
    ``fork`` (forked from verify's pre-imported interpreter; see docs/verify.md)."""


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
    launched: list[str] = field(default_factory=list)
    """How each launch of the interrupted run started, in order: ``process`` (the command as
    a new process) or ``fork`` (forked from an interpreter that had imported torch)."""
    reference_launched: str = "process"
    """How the reference run started: ``process`` or ``fork``."""
    side_by_side: bool = False
    """The interrupted run trained beside the reference, not after it."""
    differences: list[Difference] = field(default_factory=list)
    """The first difference of each component and metric, earliest first."""
    hints: list[str] = field(default_factory=list)
    """Likely causes, most likely first."""
    not_compared: list[NotCompared] = field(default_factory=list)
    """Fields left out of the comparison: volatile ones (wall-clock time, throughput) found in
    the runs, and what ``ignore`` named."""
    parted: str | None = None
    """Where the runs part, relative to the resumes: a resume problem or not (None: they
    agree)."""
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
            "launched": list(self.launched),
            "reference_launched": self.reference_launched,
            "side_by_side": self.side_by_side,
            "first_difference": first.as_dict() if first else None,
            "first_metric_difference": metric.as_dict() if metric else None,
            "differences": [d.as_dict() for d in self.differences],
            "parted": self.parted,
            "hints": list(self.hints),
            "not_compared": [n.as_dict() for n in self.not_compared],
            "work_dir": self.work_dir,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """The human-readable report (what ``unbroken verify`` prints)."""
        kills = [i for i in self.interruptions if i.exit_code != 0]  # not those too late
        how = (
            ", ".join(
                f"{i.signal} at {i.moment}" + (" (a fork)" if i.process == "fork" else "")
                for i in kills
            )
            or "none"
        )
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
            if self.parted:
                lines.append(f"  the runs part {self.parted}")
        lines.append(
            f"  interruptions: {len(kills)} ({how}); {saves} during a save; "
            f"{self.launches} launches; resumed from "
            + (", ".join(map(str, self.resumed_from)) or "-")
        )
        if self.launched:
            ref = "forked" if self.reference_launched == "fork" else "a new process"
            lines.append(
                f"  launched: reference {ref}; interrupted run: "
                f"{_launched(self.launched, self.side_by_side)}"
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
        if self.not_compared:
            lines.append(f"  not compared: {listing(self.not_compared)}")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.hints:
            lines.append("hints:")
            lines.extend(f"  - {h}" for h in self.hints)
        if self.work_dir:
            lines.append(f"run directories kept in {self.work_dir} (reference/, interrupted/)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _launched(kinds: list[str], side_by_side: bool) -> str:
    """``launch 1, 3 new processes; 2, 4 forked from a pre-imported interpreter``."""
    parts = []
    for kind, one, many in (
        ("process", "new process", "new processes"),
        ("fork", "forked (pre-imported torch)", "forked (pre-imported torch)"),
    ):
        ids = [str(i) for i, k in enumerate(kinds, 1) if k == kind]
        if ids:
            parts.append(f"{', '.join(ids)} {many if len(ids) > 1 else one}")
    where = "beside the reference" if side_by_side else "after the reference"
    return f"launch {'; '.join(parts)}; {where}"


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
    "unbroken.MapLoader(dataset, ..., seed=...) and pass it to Run (loader=loader)."
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
    "per-sample randomness can come from unbroken.MapLoader's per-sample generator "
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


SAMPLES = (
    "The batch's samples differ at step {step}, the first step after the resume from step "
    "{resume}: the relaunched process reads other samples. The data position is not restored: "
    "a loader not passed to Run, a sampler or dataset that shuffles with a generator of its own, "
    "or a batch size that depends on something not restored. Use unbroken.MapLoader(dataset, "
    "..., seed=...) and pass it to Run (loader=loader)."
)
BATCH_MADE = (
    "The batch differs at step {step}, the first step after the resume from step {resume} "
    "(its logged {keys}), while the tracked loader's position ({loader}) agrees at every "
    "checkpoint: most likely the same samples made into another batch. A collate_fn or "
    "transform that draws from a generator of its own (transformers' "
    "DataCollatorForLanguageModeling(seed=...), a torch.Generator, random.Random or numpy "
    "Generator kept in a collator) is not saved and restarts from its seed after a relaunch. "
    "Drop that generator and draw from the global streams (unbroken.MapLoader and "
    "TransformersTrainer seed them per batch for the collate_fn), per sample "
    "(dataset.get_sample(i, generator)), or pass the generator to Run. If the samples "
    "themselves differ, a sampler or dataset shuffles with a generator of its own."
)
RNG_AHEAD = (
    "A random draw made ahead of the save: at step {step}, the first step after the resume from "
    "step {resume}, the loss already differs, and the global random streams (component 'rng') "
    "differ from the next checkpoint on. Something drew from the global streams for the next "
    "step before run.step() saved them, and the relaunched process draws it again from the "
    "restored streams: a collate that masks or augments at random run outside the loader on a "
    "batch fetched ahead (frameworks fetch the next step's batch before they save; a collate_fn "
    "given to unbroken.MapLoader is seeded per batch), or noise prepared for the next step. "
    "Draw a step's randomness in that step, per sample in the dataset (unbroken.MapLoader seeds "
    "each sample), or from a torch.Generator passed to Run."
)
REDUCTION = (
    "The first step after the resume from step {resume} (step {step}) computed the same loss as "
    "the uninterrupted run ({agree}), yet the weights differ by step {upto}: the relaunched "
    "process reduced gradients in another order, and a floating-point sum depends on its order. "
    "{ranks}A new DistributedDataParallel reduces its first backward in one flat bucket and "
    "later ones in the buckets it rebuilds, so a resumed process's first step adds the ranks' "
    "gradients at other positions; with 3 or more ranks that changes the sums (2 ranks: a + b = "
    "b + a). Run() makes every DDP it tracks reduce in one layout, but not a DDP with a "
    "communication hook of your own (Run warned: ResumeWarning) or one it does not see; with "
    "NCCL, a resume on other nodes may pick another algorithm (NCCL_ALGO=Ring, "
    "NCCL_PROTO=Simple). See docs/distributed.md ('What is bitwise where'): "
    "unbroken.train.CanonicalGradients sums in one order on every world size; if rounding "
    "differences are acceptable, compare with --atol/--rtol."
)


@dataclass(frozen=True, slots=True)
class _Onset:
    """Where the runs part, relative to the resumes."""

    step: int
    """The first step where they differ (for ``update``: the first step after the resume)."""
    resume: int | None
    """The last resume before it (None: before any resume took effect)."""
    first_resume: int | None
    first_after: bool
    """It is the first step after that resume."""
    update: bool
    """The first step after the resume logged the same loss, yet the weights part by the next
    checkpoint: an update differs, the first one's most likely."""
    pinned: bool
    """For ``update``: the evidence pins it to the first step (the next loss, or a checkpoint
    right after it, differs), not only to the steps up to the next checkpoint."""
    at: list[Difference]
    """What differs where it was first seen."""
    agree: list[str]
    """Keys logged at the first step after the resume that agree there."""
    differ: list[str]
    """Keys logged at the first step after the resume that differ there."""


def _onset(cmp: Comparison, resumed_from: list[int]) -> _Onset | None:
    diffs = cmp.differences
    if not diffs:
        return None
    first = diffs[0].step
    resumes = sorted({r for r in [*resumed_from, *cmp.resumes] if r > 0})
    first_resume = resumes[0] if resumes else None
    before = [r for r in resumes if r < first]
    resume = before[-1] if before else None
    at = [d for d in diffs if d.step == first]
    row = cmp.after_resume.get(resume + 1, {}) if resume is not None else {}
    agree = [k for k, same in row.items() if same]
    differ = [k for k, same in row.items() if not same]
    update = pinned = False
    weights = [
        d.step for d in diffs if cmp.kinds.get(d.component.split("@")[0]) in ("module", "optimizer")
    ]
    same_batch = not any(_is_samples(k) for k in differ)
    if resume is not None and row.get("loss") is True and weights and same_batch:
        # The loss of the first step after the resume agrees: same weights, and the same batch
        # unless its logged samples differ. Values logged after the update (an EMA's loss) may
        # differ at that step. If the next loss differs, or the weights at a checkpoint right
        # after, that step's update did; if only the weights at the next checkpoint do (a
        # rounding-sized difference may take steps to reach the logged loss), one of the
        # updates up to it did.
        loss = next((d for d in diffs if d.component == "metrics" and d.key == "loss"), None)
        if loss is None or loss.step >= resume + 2:
            pinned = (loss is not None and loss.step == resume + 2) or weights[0] <= resume + 2
            later = [s for s in cmp.steps if s > resume]
            update = pinned or (bool(later) and weights[0] == later[0])
    step = resume + 1 if update and resume is not None else first
    first_after = resume is not None and step == resume + 1
    return _Onset(step, resume, first_resume, first_after, update, pinned, at, agree, differ)


def _is_samples(key: str) -> bool:
    """A logged key naming the batch's samples (``samples``, ``sample_ids``, ``indices``)."""
    parts = set(key.lower().replace("-", "_").split("_"))
    return bool(parts & {"sample", "samples", "indices", "index", "ids", "idx"}) or key == "batch"


def _is_content(key: str) -> bool:
    """A logged key that sums up the batch's content (``batch``, ``batch_checksum``), not
    only which samples it holds."""
    parts = set(key.lower().replace("-", "_").split("_"))
    return key == "batch" or bool(parts & {"checksum", "digest", "hash"})


def _shown(d: Difference) -> str:
    if d.kind == "tensor" and d.max_abs_diff is not None:
        return f"{d.where} (max |Δ| {d.max_abs_diff:.3g})"
    return f"{d.where} ({d.reference} vs {d.other})"


def parted(cmp: Comparison, resumed_from: list[int]) -> str | None:
    """Where the runs part and what that says: before any resume (not a resume problem), at
    the first step after one, or later. None when they agree."""
    o = _onset(cmp, resumed_from)
    if o is None:
        return None
    seen = ", ".join(_shown(d) for d in o.at[:3]) + (" ..." if len(o.at) > 3 else "")
    if o.resume is None:
        when = (
            f"before the first resume took effect (step {o.first_resume})"
            if o.first_resume is not None
            else "with no resume in between"
        )
        return (
            f"at step {o.step}, {when}: not a resume problem, the script does not repeat "
            f"itself; there: {seen}"
        )
    agree = ", ".join(f"metrics.{k}" for k in o.agree)
    verb = "agree" if len(o.agree) > 1 else "agrees"
    if o.update and o.pinned:
        return (
            f"at step {o.step}, the first step after the resume from step {o.resume}: a resume "
            f"problem; its logged {agree} {verb}, the update it made does not: {seen} at step "
            f"{o.at[0].step}"
        )
    if o.update:
        return (
            f"after the resume from step {o.resume}, by the next checkpoint (step "
            f"{o.at[0].step}): a resume problem; at step {o.step}, the first step after the "
            f"resume, the logged {agree} {verb}, the weights at the checkpoint do not: {seen}"
        )
    if o.first_after:
        text = (
            f"at step {o.step}, the first step after the resume from step {o.resume}: a resume "
            f"problem (the runs agree up to the resume); there: {seen}"
        )
        return text + (f"; {agree} {verb}" if agree else "")
    return (
        f"at step {o.step}, {o.step - o.resume} steps after the resume from step {o.resume}: "
        f"a resume problem, or state that drifts (the runs agree up to the resume); there: {seen}"
    )


def hints_for(cmp: Comparison, resumed_from: list[int]) -> list[str]:
    """Likely causes of the differences, the best evidenced first.

    Evidence, strongest first: the runs differ before any resume (not a resume problem); what
    the Run's start-up audit recorded (draws after Run(), module state outside the
    state_dict); a callback's saved overrides; parameters no tracked module owns; no tracked
    loader; the learning rate; the loader's position; the optimizer's step count; what differs
    at the first step after the resume where the runs part (the batch's samples, or what a
    collate made of them while the loader's position agrees; a random draw made ahead of the
    save; only the update, its loss agreeing: the reduction); the random streams; then the
    usual suspects of a model that diverges.
    """
    if cmp.passed:
        return []
    diffs = cmp.differences
    hints: list[str] = []
    onset = _onset(cmp, resumed_from)
    assert onset is not None
    first_resume = onset.first_resume
    if onset.resume is None:  # no resume before the first difference
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
    rng_first = any(d.component.split("@")[0] == "rng" for d in at_first)
    ahead = False
    if onset is not None and onset.first_after and onset.resume is not None:
        where = {"step": onset.step, "resume": onset.resume}
        samples = [k for k in onset.differ if _is_samples(k)]
        moved = {d.component.split("@")[0] for d in state} & set(loaders)
        made = bool(loaders) and not moved and not rng_first and all(map(_is_content, samples))
        if samples and made:
            # Only a checksum of the batch differs (not its sample ids), the loader's position
            # and the global streams agree: what was made of the samples, by a generator of
            # the collate's own (a draw from the global streams made ahead is RNG_AHEAD).
            logged = ", ".join(f"metrics.{k}" for k in samples)
            hints.append(BATCH_MADE.format(**where, keys=logged, loader=", ".join(loaders)))
        elif samples:
            hints.append(SAMPLES.format(**where))
        ahead = rng_first and "loss" in onset.differ
        if ahead:  # RNG, made precise
            hints.append(RNG_AHEAD.format(**where))
        if onset.update and not rng_first and (onset.pinned or cmp.world_size > 1):
            upto = onset.at[0].step
            hints.append(
                REDUCTION.format(**where, upto=upto, agree=_agreeing(onset), ranks=_ranks(cmp))
            )
    if rng_first and UNSEEDED_GLOBAL not in hints and not ahead:
        hints.append(RNG)
    if not state:
        hints += [EMA_METRIC.format(key=d.key) for d in diffs if "ema" in d.key.lower()][:1]
        hints.append(METRICS_ONLY)
    else:
        hints += [GENERATOR, COMPONENT, HIDDEN_GENERIC, NONDET_OPS]
    return list(dict.fromkeys(hints))


def _agreeing(onset: _Onset) -> str:
    keys = [k for k in onset.agree if k == "loss" or _is_samples(k)]
    return "its logged " + " and ".join(keys) + (" agree" if len(keys) > 1 else " agrees")


def _ranks(cmp: Comparison) -> str:
    if cmp.world_size > 1:
        return f"The run has {cmp.world_size} ranks. "
    return (
        "In one process: the step's gradients were accumulated in another order (micro-batches "
        "or per-sample backward passes reordered in a fresh process, a hook with state of its "
        "own). Across ranks: "
    )


def _is_lr(d: Difference) -> bool:
    if d.component == "metrics":
        key = d.key.lower().replace("-", "_")
        return "lr" in key.split("_") or "learning_rate" in key
    return bool({"lr", "initial_lr", "_last_lr"} & set(d.key.split(".")))
