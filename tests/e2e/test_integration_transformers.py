"""Hugging Face transformers: examples/hf_trainer_lm.py (a tiny randomly initialised GPT-2 from
a ``GPT2Config``, ``TrainingArguments`` with warmup, gradient accumulation over 2 micro-batches,
``dataloader_num_workers=2``, ``max_steps``; GPT-2's dropout) interrupted in a separate process
and relaunched from fresh objects ends bit for bit where the uninterrupted run ends; the
Trainer's own ``resume_from_checkpoint`` does not.

An epoch is 5 micro-batches (40 windows, batch 8), so accumulation windows span epoch ends and
the interrupts fall mid-epoch and mid-window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.golden import (  # noqa: E402
    ROOT,
    assert_identical,
    launch,
    run_interrupted,
    trainer_state,
)

EXAMPLE = ROOT / "examples" / "hf_trainer_lm.py"
INTERRUPT = ROOT / "tests" / "scripts" / "interrupt.py"
NATIVE = ROOT / "tests" / "scripts" / "hf_native.py"
ARGS = ["--steps", "14", "--save-every", "3", "--epoch-samples", "40", "--workers", "2"]
ARGS += ["--eval-every", "5"]  # evaluation (a torch DataLoader of its own) at steps 5, 10, 14


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf-ref")
    assert launch(EXAMPLE, [*ARGS, "--run-dir", str(d)]) == 0
    return d


def test_interrupted_equals_uninterrupted(reference: Path, tmp_path: Path) -> None:
    # SIGKILL after step 4 (mid-epoch 1): resumes from step 3, whose window spanned epochs 0-1.
    # SIGTERM after step 8: the step in progress (9) ends, is saved, exit 75 (mid-epoch 3).
    # Ctrl-C after step 11: step 12 is saved (mid-epoch 4, mid-way through a 5-batch epoch).
    interrupts = [(4, "KILL"), (8, "TERM"), (11, "INT")]
    run_interrupted(INTERRUPT, [str(EXAMPLE), *ARGS], tmp_path, interrupts)
    # Every tensor, every component's state, the metrics log; the TrainerState below, without
    # the wall-clock fields the Trainer puts into its log history (eval_runtime, ...).
    assert_identical(reference, tmp_path, ignore=("trainer_state",))
    sa, sb = trainer_state(reference), trainer_state(tmp_path)
    assert sa == sb
    assert [e["step"] for e in sa["state"]["log_history"] if "loss" in e] == list(range(1, 15))
    assert [e["step"] for e in sa["state"]["log_history"] if "eval_loss" in e] == [5, 10, 14]
    wa = load_file(str(reference / "final.safetensors"))
    wb = load_file(str(tmp_path / "final.safetensors"))
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    assert (reference / "trace.jsonl").read_text() == (tmp_path / "trace.jsonl").read_text()
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 14


def test_trainer_own_resume_diverges(tmp_path: Path) -> None:
    # Checkpoint every 5 steps (step 5 is mid-epoch 1); SIGKILL after step 7; resume from 5.
    args = ["--steps", "14", "--save-every", "5"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert launch(NATIVE, [*args, "--run-dir", str(straight)]) == 0
    assert launch(NATIVE, [*args, "--run-dir", str(killed), "--kill-at", "7"]) != 0
    assert launch(NATIVE, [*args, "--run-dir", str(killed)]) == 0
    wa = load_file(str(straight / "final.safetensors"))
    wb = load_file(str(killed / "final.safetensors"))
    assert any(not torch.equal(wa[k], wb[k]) for k in wa), "the Trainer's resume was exact"


def _trainer(run_dir: Path, callbacks=(), max_steps: int = 2, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from unbroken.integrations import TransformersTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    ids = torch.randint(11, (8, 8))
    data = [{"input_ids": x, "labels": x} for x in ids]
    trainer_kw = {k: kw.pop(k) for k in list(kw) if k in ("strict", "run_options", "extra")}
    args = TrainingArguments(
        output_dir=str(run_dir),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        **kw,
    )
    return TransformersTrainer(
        model=model, args=args, train_dataset=data, callbacks=list(callbacks), **trainer_kw
    )


def test_what_cannot_be_exact_is_refused_by_name(tmp_path: Path) -> None:
    from unbroken import ConfigError

    with pytest.raises(ConfigError, match=r"needs TrainingArguments\(max_steps=N\)"):
        _trainer(tmp_path, max_steps=-1)
    with pytest.raises(ConfigError, match="save_strategy='epoch'.*strict=False"):
        _trainer(tmp_path, save_strategy="epoch")
    with pytest.raises(ConfigError, match=r"\['max_steps'\] are not options here"):
        _trainer(tmp_path, run_options={"max_steps": 3})
    with pytest.raises(ConfigError, match="drop resume_from_checkpoint"):
        _trainer(tmp_path).train(resume_from_checkpoint=True)


def test_callback_without_state_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import TrainerCallback

    import unbroken
    from unbroken import ConfigError

    class Counter(TrainerCallback):
        pass

    with pytest.raises(ConfigError, match="callback Counter has no state_dict"):
        _trainer(tmp_path / "strict", [Counter()]).train()
    with caplog.at_level("WARNING", logger="unbroken"):
        trainer = _trainer(tmp_path / "lax", [Counter()], strict=False)
        trainer.train()
    assert "callback Counter has no state_dict" in caplog.text
    assert [m["step"] for m in unbroken.read_metrics(str(tmp_path / "lax"))] == [1, 2]
    # A relaunch of the complete run trains no further step.
    again = _trainer(tmp_path / "lax", [Counter()], strict=False)
    again.train()
    assert again.state.global_step == 2
    assert [m["step"] for m in unbroken.read_metrics(str(tmp_path / "lax"))] == [1, 2]
