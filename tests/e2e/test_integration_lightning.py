"""PyTorch Lightning: examples/lightning_lm.py (LightningModule + Trainer(max_steps), 2 loader
workers, dropout) interrupted in a separate process and relaunched from fresh objects ends bit
for bit where the uninterrupted run ends; Lightning's own resume does not.

An epoch is 3 batches (40 windows, batch 16, the last one short), so the interrupts fall
mid-epoch and on epoch ends.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from safetensors.torch import load_file  # noqa: E402

from tests.golden import (  # noqa: E402
    ROOT,
    assert_identical,
    launch,
    resume_steps,
    run_interrupted,
)

EXAMPLE = ROOT / "examples" / "lightning_lm.py"
INTERRUPT = ROOT / "tests" / "scripts" / "interrupt.py"
NATIVE = ROOT / "tests" / "scripts" / "lightning_native.py"
ARGS = ["--steps", "14", "--save-every", "5", "--epoch-samples", "40", "--workers", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lightning-ref")
    assert launch(EXAMPLE, [*ARGS, "--run-dir", str(d)]) == 0
    return d


def _same_final(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "final.safetensors")), load_file(str(b / "final.safetensors"))
    assert wa.keys() == wb.keys()
    diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not diff, f"final weights differ: {diff}"
    assert (a / "trace.jsonl").read_text() == (b / "trace.jsonl").read_text()


def test_interrupted_equals_uninterrupted(reference: Path, tmp_path: Path) -> None:
    # SIGTERM after step 6, the end of epoch 1 (Lightning's notifier is chained, its loop does
    # not act on it): saves step 7, the first batch of epoch 2, the step in progress. Ctrl-C
    # after step 8: saves step 9, the end of epoch 2. SIGKILL after step 11, mid-epoch 3:
    # resumes from step 10.
    run_interrupted(
        INTERRUPT, [str(EXAMPLE), *ARGS], tmp_path, [(6, "TERM"), (8, "INT"), (11, "KILL")]
    )
    assert resume_steps(tmp_path) == [7, 9, 10]
    assert_identical(reference, tmp_path)
    _same_final(reference, tmp_path)


def test_lightning_own_resume_diverges(tmp_path: Path) -> None:
    args = ["--steps", "14", "--save-every", "5"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert launch(NATIVE, [*args, "--run-dir", str(straight)]) == 0
    assert launch(NATIVE, [*args, "--run-dir", str(killed), "--kill-at", "7"]) != 0
    assert launch(NATIVE, [*args, "--run-dir", str(killed)]) == 0
    wa = load_file(str(straight / "final.safetensors"))
    wb = load_file(str(killed / "final.safetensors"))
    assert any(not torch.equal(wa[k], wb[k]) for k in wa), "Lightning's resume was exact"


def test_slurm_requeue_handler_still_runs(reference: Path, tmp_path: Path) -> None:
    """SIGUSR1 under SLURM auto-requeue: Lightning's handler calls `scontrol requeue`; unbroken
    saves the step and exits 75; the relaunch continues exactly."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "scontrol.log"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {marker}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    run_dir = tmp_path / "run"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        code = launch(
            INTERRUPT,
            [
                str(EXAMPLE),
                *ARGS,
                "--run-dir",
                str(run_dir),
                "--signal-at",
                "6",
                "--signal",
                "USR1",
            ],
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert code == 75
    assert marker.read_text().split() == ["requeue", "4242"], "Lightning's requeue did not run"
    assert launch(INTERRUPT, [str(EXAMPLE), *ARGS, "--run-dir", str(run_dir)]) == 0
    assert_identical(reference, run_dir)


def _fit(run_dir: Path, loader, callbacks=(), **kw) -> None:
    import pytorch_lightning as pl

    from unbroken.integrations import LightningCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, LightningCallback(str(run_dir), **kw)],
    )
    trainer.fit(Tiny(), train_dataloaders=loader)


def _data():
    return torch.utils.data.TensorDataset(torch.randn(8, 4))


def test_torch_dataloader_is_refused_by_name(tmp_path: Path) -> None:
    from unbroken import ConfigError

    with pytest.raises(ConfigError, match=r"torch\.utils\.data\.dataloader\.DataLoader.*unbroken"):
        _fit(tmp_path, torch.utils.data.DataLoader(_data(), batch_size=4))


def test_a_loader_built_for_another_world_is_refused(tmp_path: Path) -> None:
    """A loader built before fit() started the process group is a one-process loader: under
    DDP every rank would train on the whole global batch. Here the mirror case (a loader for
    rank 0 of 2 in a one-process fit) meets the same check, before anything trains."""
    import unbroken
    from unbroken import ConfigError

    loader = unbroken.MapLoader(_data(), batch_size=4, seed=0, rank=0, world_size=2)
    with pytest.raises(
        ConfigError, match=r"built for rank 0 of 2, but this process is rank 0 of 1"
    ):
        _fit(tmp_path, loader)
    assert not (tmp_path / "metrics.jsonl").exists() or not unbroken.read_metrics(str(tmp_path))


def test_callback_without_state_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import pytorch_lightning as pl

    import unbroken
    from unbroken import ConfigError

    class Counter(pl.Callback):
        pass

    loader = unbroken.MapLoader(_data(), batch_size=4, seed=0)
    with pytest.raises(ConfigError, match="callback Counter has no state_dict"):
        _fit(tmp_path / "strict", loader, [Counter()])
    with caplog.at_level("WARNING", logger="unbroken"):
        _fit(tmp_path / "lax", loader, [Counter()], strict=False)
    assert "callback Counter has no state_dict" in caplog.text
    assert [m["step"] for m in unbroken.read_metrics(str(tmp_path / "lax"))] == [1, 2]


def test_unknown_option_is_refused() -> None:
    from unbroken import ConfigError
    from unbroken.integrations import LightningCallback

    with pytest.raises(ConfigError, match=r"\['max_steps'\] are not options here"):
        LightningCallback("runs/x", max_steps=3)


# ---- the unified package: import lightning as L ---------------------------------------------

UNIFIED = ROOT / "tests" / "scripts" / "lightning_unified.py"


def test_unified_lightning_package_with_a_datamodule_and_validation(tmp_path: Path) -> None:
    """``import lightning as L`` (``lightning.pytorch``), a LightningDataModule returning
    unbroken.MapLoaders, a validation loop every 4 steps, and a field ``training_step``
    returns. SIGTERM after step 6 (mid-epoch; the stop saves step 7, the step in progress),
    SIGKILL after step 9 (after the validation of step 8; resumes from step 7): equal to the
    uninterrupted run."""
    pytest.importorskip("lightning")
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert launch(UNIFIED, ["--run-dir", str(ref)]) == 0
    run_interrupted(INTERRUPT, [str(UNIFIED)], cut, [(6, "TERM"), (9, "KILL")])
    assert resume_steps(cut) == [7]  # the killed launch's resume is rewound with its steps
    assert_identical(ref, cut)
    _same_final(ref, cut)
    import unbroken

    rows = unbroken.read_metrics(cut)
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert all(isinstance(r.get("accuracy"), float) for r in rows), rows[:2]
    assert "import lightning as L" in UNIFIED.read_text()
