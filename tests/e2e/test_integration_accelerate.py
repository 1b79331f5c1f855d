"""Hugging Face Accelerate: examples/accelerate_lm.py (``accelerator.prepare``, gradient
accumulation over 2 micro-batches, 2 loader workers, dropout) interrupted in a separate process
and relaunched from fresh objects ends bit for bit where the uninterrupted run ends;
Accelerate's own ``save_state``/``load_state`` + ``skip_first_batches`` resume does not.

An epoch is 5 micro-batches (40 windows, batch 8), so accumulation windows span epoch ends and
the interrupts fall mid-epoch and mid-window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from safetensors.torch import load_file  # noqa: E402

from tests.golden import ROOT, assert_identical, launch, run_interrupted  # noqa: E402

EXAMPLE = ROOT / "examples" / "accelerate_lm.py"
INTERRUPT = ROOT / "tests" / "scripts" / "interrupt.py"
NATIVE = ROOT / "tests" / "scripts" / "accelerate_native.py"
ARGS = ["--steps", "14", "--save-every", "3", "--epoch-samples", "40", "--workers", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("accelerate-ref")
    assert launch(EXAMPLE, [*ARGS, "--run-dir", str(d)]) == 0
    return d


def test_interrupted_equals_uninterrupted(reference: Path, tmp_path: Path) -> None:
    # Resumes after a window that spanned epochs 0-1; then mid-window; then mid-epoch.
    interrupts = [(4, "KILL"), (8, "TERM"), (11, "INT")]
    run_interrupted(INTERRUPT, [str(EXAMPLE), *ARGS], tmp_path, interrupts)
    assert_identical(reference, tmp_path)
    wa = load_file(str(reference / "final.safetensors"))
    wb = load_file(str(tmp_path / "final.safetensors"))
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    assert (reference / "trace.jsonl").read_text() == (tmp_path / "trace.jsonl").read_text()


def test_accelerate_own_resume_diverges(tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert launch(NATIVE, ["--run-dir", str(straight)]) == 0
    assert launch(NATIVE, ["--run-dir", str(killed), "--kill-at", "7"]) != 0
    assert launch(NATIVE, ["--run-dir", str(killed)]) == 0
    wa = load_file(str(straight / "final.safetensors"))
    wb = load_file(str(killed / "final.safetensors"))
    assert any(not torch.equal(wa[k], wb[k]) for k in wa), "Accelerate's resume was exact"


def test_prepared_torch_dataloader_is_refused_by_name(tmp_path: Path) -> None:
    from accelerate import Accelerator

    import unbroken
    from unbroken import ConfigError
    from unbroken.integrations import accelerate_run

    accelerator = Accelerator()
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    model, loader = accelerator.prepare(model, torch.utils.data.DataLoader(data, batch_size=4))
    with pytest.raises(ConfigError, match="wrapped a DataLoaderShard.*unbroken.MapLoader"):
        accelerate_run(accelerator, str(tmp_path), loader=loader)
    with pytest.raises(ConfigError, match="no unbroken.MapLoader was given"):
        accelerate_run(Accelerator(), str(tmp_path))
    fine = unbroken.MapLoader(data, batch_size=4, seed=0)
    with pytest.raises(ConfigError, match=r"\['model'\] are tracked from the accelerator"):
        accelerate_run(accelerator, str(tmp_path), loader=fine, model=model, strict=False)
