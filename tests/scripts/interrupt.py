"""Run a training script, sending the process a signal right after optimizer step K.

    python tests/scripts/interrupt.py SCRIPT [SCRIPT ARGS...] --signal-at K --signal TERM|KILL|...
        [--signal-phase after|start|lightning:HOOK] [--signal-tree]

``after`` (default) signals when ``run.step()`` for step K returns (K=0: right after the Run is
created); ``start`` signals at the start of step K+1, after its callbacks ran (e.g. right after a
model change), before any of its micro-batches. ``lightning:HOOK`` (``pytorch_lightning``
scripts) signals when Lightning first calls the callback hook HOOK at global step K, outside the
sanity check, before any callback runs it: ``lightning:on_train_batch_start`` lands in the first
micro-batch of step K+1, ``lightning:on_validation_end`` after the last batch of the
validation run at step K. ``--signal-tree`` signals every process of this
one's tree (its DataLoader workers too), as a scheduler does. The script itself runs unchanged.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any


def _take(argv: list[str], flag: str, default: str | None = None) -> str | None:
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def main() -> None:
    argv = sys.argv[1:]
    at = _take(argv, "--signal-at")
    sig = getattr(signal, "SIG" + (_take(argv, "--signal", "KILL") or "KILL"))
    phase = _take(argv, "--signal-phase", "after")
    whole_tree = "--signal-tree" in argv
    if whole_tree:
        argv.remove("--signal-tree")
    if at is not None:
        _arm(int(at), sig, phase or "after", whole_tree)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def _arm(at: int, sig: int, phase: str, whole_tree: bool) -> None:
    import unbroken
    from unbroken.train import _loop, _run

    def fire() -> None:
        pids = [os.getpid()]
        for pid in pids if whole_tree else []:  # grows as children are found
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    pids.extend(int(p) for p in f.read().split())
            except OSError:
                pass
        for pid in reversed(pids):  # the workers first, this process last
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    if phase.startswith("lightning:"):
        _arm_lightning(at, phase.split(":", 1)[1], fire)
    elif phase == "after":
        step, init = _run.Run.step, _run.Run.__init__

        def patched_step(self, *a, **k):  # type: ignore[no-untyped-def]
            out = step(self, *a, **k)
            if self.counters.step == at:
                fire()
            return out

        def patched_init(self, *a, **k):  # type: ignore[no-untyped-def]
            init(self, *a, **k)
            if at == 0 and self.counters.step == 0:
                fire()

        _run.Run.step = patched_step  # type: ignore[method-assign]
        _run.Run.__init__ = patched_init  # type: ignore[method-assign]
    else:
        begin = _loop.Stepper.begin_step

        def patched_begin(self, loader):  # type: ignore[no-untyped-def]
            out = begin(self, loader)
            if self.counters.step == at:
                fire()
            return out

        _loop.Stepper.begin_step = patched_begin  # type: ignore[method-assign]
    assert unbroken


def _arm_lightning(at: int, hook: str, fire: Any) -> None:
    from pytorch_lightning.trainer import call

    calls = call._call_callback_hooks
    fired = False

    def patched(trainer, hook_name, *a, **k):  # type: ignore[no-untyped-def]
        nonlocal fired
        if (
            not fired
            and hook_name == hook
            and not trainer.sanity_checking
            and trainer.global_step == at
        ):
            fired = True
            fire()
        return calls(trainer, hook_name, *a, **k)

    call._call_callback_hooks = patched


if __name__ == "__main__":
    main()
