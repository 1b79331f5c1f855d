"""Format 1 checkpoints (written by unbroken 0.1's writer, tests/data/) still load and resume.

Two fixtures: ``v1-run`` as the old writer left it, and ``v1-run-enum``, the same with
``.metadata`` pickled the way CPython 3.11.0-3.11.4 pickle Enum members
(``builtins.getattr(cls, name)``), which the old reader refused -- so a run directory written
there started over from step 0 (issue 11). tests/data/make_v1_fixtures.py made both.
"""

from __future__ import annotations

import io
import os
import pickletools
import shutil

import pytest
import torch

import unbroken
from tests._store_helpers import assert_same, load_snapshot, make_registry, restore, train
from unbroken.store import CheckpointStore

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _opcodes(path: str) -> str:
    out = io.StringIO()
    with open(path, "rb") as f:
        pickletools.dis(f.read(), out=out)
    return out.getvalue()


def test_the_enum_fixture_holds_the_311_opcodes() -> None:
    """The fixture really has what 3.11.0-3.11.4 wrote (so the tests below can fail)."""
    md = os.path.join(DATA, "v1-run-enum", "checkpoints", "step-000000002", ".metadata")
    text = _opcodes(md)
    assert "'getattr'" in text and "'builtins'" in text
    plain = _opcodes(os.path.join(DATA, "v1-run", "checkpoints", "step-000000002", ".metadata"))
    assert "'getattr'" not in plain


@pytest.mark.parametrize("fixture", ["v1-run", "v1-run-enum"])
def test_format_1_loads_exactly(fixture: str) -> None:
    reader = CheckpointStore(os.path.join(DATA, fixture)).latest()
    assert reader is not None and reader.step == 2 and reader.format_version == 1
    reader.check_contents()
    assert_same(restore(reader), load_snapshot(os.path.join(DATA, "v1-expect-2")))


@pytest.mark.parametrize("fixture", ["v1-run", "v1-run-enum"])
def test_a_run_resumes_from_format_1_and_saves_format_2(fixture: str, tmp_path) -> None:
    """Run resumes the old directory (not from step 0) and continues exactly as the state the
    old writer saved, restored and trained on by hand; its own next checkpoint is format 2."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(DATA, fixture), run_dir)
    ref = make_registry(seed=5)
    r = CheckpointStore(run_dir).latest()
    assert r is not None
    trees = {**r.global_trees(), **(r.local_trees(0) or {})}
    names = ref.check_names(trees)
    targets = ref.plan(names, trees, r.tensor_infos())
    r.load_tensors(targets)
    ref.restore(names, trees, targets)
    train(ref, 3)

    reg = make_registry(seed=7)
    model, opt, sched = reg.get("model"), reg.get("optimizer"), reg.get("scheduler")
    run = unbroken.Run(run_dir, model=model, optimizer=opt, scheduler=sched, progress=False)
    assert run.resumed_from == 2 and run.counters.step == 2
    g = torch.Generator().manual_seed(1000 + 2)  # as train() seeds it at step 2
    for _ in range(3):
        model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        run.step()
    run.save()
    run.close()
    for k, v in ref.get("model").state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for k, v in ref.get("optimizer").state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(opt.state_dict()["state"][k][name], t), (k, name)
    newest = CheckpointStore(run_dir).latest()
    assert newest is not None and newest.step == 5 and newest.format_version == 2
    assert "tensors.json" in os.listdir(newest.path)
