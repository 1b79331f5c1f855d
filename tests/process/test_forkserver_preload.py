"""A fork server started for a script that imports a framework has imported it before the
script's first line runs (so a fork skips seconds of import), and runs the script unchanged."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.golden import ROOT
from unbroken.verify._forkserver import ForkServer, preloads

CHILD = """
import sys
before = "transformers.configuration_utils" in sys.modules
from transformers import PretrainedConfig
print("preloaded:", before, PretrainedConfig.__name__)
"""


def test_the_framework_is_imported_by_the_server(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "child.log"
    for preload, expected in ((preloads(str(script)), "True"), ([], "False")):
        server = ForkServer(sys.executable, env, str(tmp_path / "server.log"), preload)
        try:
            assert server.ready(180), (tmp_path / "server.log").read_text()
            log.write_text("")
            proc = server.spawn([sys.executable, str(script)], env, str(tmp_path), str(log))
            assert proc.wait(timeout=180) == 0, log.read_text()
        finally:
            server.close()
        assert log.read_text().split() == ["preloaded:", expected, "PreTrainedConfig"]
