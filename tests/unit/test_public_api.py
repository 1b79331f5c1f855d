"""The public face (docs/design.md, "A top level of what a script needs"): a small sorted top
level whose every name resolves, the rest in packages, one naming style for the integrations,
and the first releases' names still working for one release, each with a warning that names
its replacement."""

from __future__ import annotations

import importlib
import re
import types
import warnings
from typing import Any

import pytest

import unbroken
import unbroken.data
import unbroken.integrations
import unbroken.train

DEPRECATING = [unbroken, unbroken.data, unbroken.integrations, unbroken.train]
OLD_NAMES = [
    pytest.param(package, old, new, id=f"{package.__name__}.{old}")
    for package in DEPRECATING
    for old, new in package._DEPRECATED.items()
]


def _resolve(dotted: str) -> Any:
    home, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(home), name)


def test_the_top_level_is_small_sorted_and_resolves() -> None:
    names = unbroken.__all__
    assert names == sorted(names)
    assert len(names) <= 28, f"{len(names)} top-level names: the rest belongs in a package"
    for name in names:
        assert getattr(unbroken, name) is not None, name


def test_dir_offers_the_public_names_and_packages_only() -> None:
    public = {
        n
        for n in dir(unbroken)
        if not n.startswith("_")
        and not isinstance(getattr(unbroken, n), types.ModuleType)
        and n not in {"annotations", "TYPE_CHECKING"}
    }
    assert public == set(unbroken.__all__) - {"__version__"}
    for package in DEPRECATING:
        assert not set(package._DEPRECATED) & set(dir(package)), package.__name__


@pytest.mark.parametrize("name", unbroken._PACKAGES)
def test_a_package_is_reachable_from_a_plain_import(name: str) -> None:
    module = getattr(unbroken, name)
    assert isinstance(module, types.ModuleType) and module.__name__ == f"unbroken.{name}"


@pytest.mark.parametrize(("package", "old", "new"), OLD_NAMES)
def test_an_old_name_warns_with_its_new_place_and_is_the_same_object(
    package: types.ModuleType, old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if new.endswith(".TransformersTrainer"):
        # Building the real class imports transformers (seconds); the alias is looked up by
        # name in unbroken.integrations, where the first lookup caches it: stand in there.
        # (setitem on the namespace: setattr would read the old value, building the class)
        monkeypatch.setitem(vars(unbroken.integrations), "TransformersTrainer", object())
    with pytest.warns(DeprecationWarning, match=re.escape(f"use {new}")) as caught:
        value = getattr(package, old)
    assert f"{package.__name__}.{old}" in str(caught[0].message)
    assert value is _resolve(new)
    assert old not in package.__all__
    assert new.rsplit(".", 1)[1] in importlib.import_module(new.rsplit(".", 1)[0]).__all__


def test_from_import_of_an_old_name_still_works() -> None:
    with pytest.warns(DeprecationWarning, match=r"unbroken\.MapLoader"):
        from unbroken import DataLoader
    assert DataLoader is unbroken.MapLoader


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            _ = unbroken.Nope  # type: ignore[attr-defined]


FRAMEWORKS = {"lightning", "transformers", "accelerate", "tensorboard", "wandb"}


@pytest.mark.parametrize("name", unbroken.integrations.__all__)
def test_each_integration_is_named_framework_first(name: str) -> None:
    """The framework's import name, then what you get; CapWords for a class, snake_case for a
    function (docs/design.md)."""
    first = re.match(r"[A-Z][a-z]+|[a-z]+", name)
    assert first is not None and first.group(0).lower() in FRAMEWORKS, name
    assert name.islower() or name[0].isupper(), name


def test_map_loader_is_not_torchs_data_loader() -> None:
    """Its name says so: another batch-size meaning and defaults than torch's DataLoader."""
    import torch.utils.data

    assert unbroken.MapLoader.__name__ == "MapLoader"
    assert not issubclass(unbroken.MapLoader, torch.utils.data.DataLoader)
    loader = unbroken.MapLoader(list(range(8)), batch_size=4, shuffle=False)
    assert [list(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"sampler": object()}, "unbroken.data.SamplerLoader"),
        ({"batch_sampler": object()}, "unbroken.data.SamplerLoader"),
        ({"generator": object()}, "pass seed instead of a generator"),
        ({"shufle": True}, "shufle"),
    ],
)
def test_a_torch_dataloader_argument_the_map_loader_does_not_take_is_named(
    kwargs: dict[str, Any], says: str
) -> None:
    """MapLoader's signature is not torch's (docs/design.md): an argument of torch's it does
    not take is named, with what to do instead, not a bare TypeError."""
    with pytest.raises(unbroken.ConfigError, match=re.escape(says)) as raised:
        unbroken.MapLoader(list(range(8)), 4, **kwargs)
    assert next(iter(kwargs)) in str(raised.value)
