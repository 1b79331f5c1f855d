"""Generate the format-1 fixtures in tests/data/ (run once, with unbroken at commit e0ee667,
the last version whose writer produced format 1: DCP ``torch_save`` records and a pickled
``.metadata``). Kept so that the fixtures' origin is reproducible; the current unbroken no
longer writes this format.

    git worktree add /tmp/v1 e0ee667 && cd /tmp/v1 && python tests/data/make_v1_fixtures.py OUT

Writes OUT/v1-run (steps 1 and 2 of tests._store_helpers.make_registry, trained as
make_run does), OUT/v1-run-enum (the same, with every Enum member in ``.metadata`` pickled as
CPython 3.11.0-3.11.4 pickle it: ``builtins.getattr(cls, name)``), and OUT/v1-expect-2.{json,pt}
(what step 2 holds).
"""

from __future__ import annotations

import enum
import os
import pickle
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests._store_helpers import (  # noqa: E402
    dump_snapshot,
    make_run,
    refresh_manifest,
)
from unbroken.store import read_metadata  # noqa: E402  (at e0ee667; now store._v1)


class _Py311EnumPickler(pickle.Pickler):
    """Pickle Enum members the way CPython 3.11.0-3.11.4 did (gh-103116, fixed in 3.11.5)."""

    def reducer_override(self, obj):  # type: ignore[no-untyped-def]
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def main(out: str) -> None:
    run = os.path.join(out, "v1-run")
    shutil.rmtree(run, ignore_errors=True)
    snaps = make_run(run, (1, 2))
    dump_snapshot(os.path.join(out, "v1-expect-2"), snaps[2])
    enum_run = os.path.join(out, "v1-run-enum")
    shutil.rmtree(enum_run, ignore_errors=True)
    shutil.copytree(run, enum_run)
    for step in (1, 2):
        path = os.path.join(enum_run, "checkpoints", f"step-{step:09d}")
        md = read_metadata(path)
        md.storage_meta = None
        with open(os.path.join(path, ".metadata"), "wb") as f:
            _Py311EnumPickler(f).dump(md)  # DCP pickles with the default protocol
        refresh_manifest(path, ".metadata")


if __name__ == "__main__":
    main(sys.argv[1])
