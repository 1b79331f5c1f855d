"""A parameter an optimizer updates but no tracked module owns is refused at start-up (issue 17).

Found from outside: a CLIP-style ``logit_scale = nn.Parameter(...)`` passed to AdamW next to the
model's parameters had its moments saved but its value saved nowhere, so after a resume it
restarted from its initial value, silently.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import unbroken


def _opt(*params: torch.nn.Parameter) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def test_a_parameter_of_no_tracked_module_is_named(tmp_path):
    model = torch.nn.Linear(3, 2)
    logit_scale = torch.nn.Parameter(torch.ones([]))
    opt = _opt(*model.parameters(), logit_scale)
    with pytest.raises(
        unbroken.StateError, match=r"updates 1 parameter\(s\) that no tracked module owns"
    ):
        unbroken.Run(tmp_path / "r", model=model, optimizer=opt, progress=False)
    # Refused before anything was opened: the directory holds no lock, a fixed script can start.
    unbroken.Run(
        tmp_path / "r",
        model=model,
        scale=torch.nn.ParameterList([logit_scale]),
        optimizer=opt,
        progress=False,
    ).close()


def test_a_module_left_out_of_run_is_named(tmp_path):
    model, head = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    opt = _opt(*model.parameters(), *head.parameters())
    with pytest.raises(
        unbroken.StateError, match=r"#2 \(shape \[1, 2\], group 0\), #3 \(shape \[1\], group 0\)"
    ):
        unbroken.Run(tmp_path / "r", model=model, optimizer=opt, progress=False)


def test_every_parameter_tracked_warns_nothing(tmp_path):
    model = torch.nn.Linear(3, 2)
    scale = torch.nn.ParameterDict({"logit_scale": torch.nn.Parameter(torch.ones([]))})
    opt = _opt(*model.parameters(), *scale.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = unbroken.Run(tmp_path / "r", model=model, scale=scale, optimizer=opt, progress=False)
    run.close()
