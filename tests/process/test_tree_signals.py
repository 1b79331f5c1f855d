"""Stop signals sent to every process of a job's tree, as SLURM and Kubernetes send them.

A few trials of the tree-signal harness (tests/treesig.py) per scenario: a plain Run whose
DataLoader workers start again every epoch, ``IterableShards`` read by workers, the Hugging
Face Trainer with persistent workers and evaluation, Accelerate. Each launch is signalled once
or twice (mixed signals, 0-400 ms apart) right after its first new checkpoint -- DataLoader
workers alive, training under way -- or just after its final save; every launch must exit 75
with its last logged step saved (0 when complete), never 1, never by a signal, never hang; the
relaunched run must equal the uninterrupted one bit for bit. ``scripts/tree_signals.py`` runs
the same scenarios (and more) at drawn moments, hundreds of times.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import treesig
from tests.treesig import Plan
from unbroken import EXIT_RESUMABLE

# (scenario, plans of the signalled launches); then launches without a signal to completion.
CASES = {
    "workers-restart": [
        Plan(0.05, False, [("TERM", 0.2), ("INT", 0.0)], after_save=True),
        Plan(0.0, True, [("USR1", 0.05), ("TERM", 0.0)]),  # just after the final save: 0
    ],
    "shards": [Plan(0.05, False, [("USR1", 0.4), ("TERM", 0.0)], after_save=True)],
    "trainer": [Plan(0.2, False, [("TERM", 0.1), ("USR1", 0.0)], after_save=True)],
    "accelerate": [Plan(0.1, False, [("INT", 0.3), ("TERM", 0.0)], after_save=True)],
}
_SAME_RESULT = {"workers-persistent": "workers-restart"}  # the same batches and noise
# Persistent workers: test_run_signals.py (a plain Run), the Trainer here, Lightning's
# validation loader in test_integration_lightning.py; all scenarios: scripts/tree_signals.py.


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        name = _SAME_RESULT.get(name, name)
        if name not in made:
            d = tmp_path_factory.mktemp(f"ref-{name}")
            treesig.reference(treesig.SCENARIOS[name], d / "run")
            made[name] = d / "run"
        return made[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_tree_wide_stop_signals_exit_75_and_resume_exactly(
    name: str, references, tmp_path: Path
) -> None:
    scenario, reference = treesig.SCENARIOS[name], references(name)
    run_dir = tmp_path / "run"
    plans = list(CASES[name])
    came, codes = 0, []
    for _ in range(len(plans) + 4):
        o = treesig.launch(scenario, run_dir, plans.pop(0) if plans else None)
        problems = treesig.check(o, run_dir)
        assert not problems, (problems, str(o.plan), o.code, o.stderr[-3000:])
        came += o.came
        codes.append(o.code)
        if o.code == 0 and not plans:
            break
    assert codes[-1] == 0, codes
    assert EXIT_RESUMABLE in codes, f"no launch was stopped: {codes}"
    assert came == len(CASES[name]), "a planned moment never came"
    assert not (diff := treesig.compare(scenario, reference, run_dir)), diff
