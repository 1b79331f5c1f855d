"""tests/forks.py: a launch that hangs past its time is shown where it hangs (every thread's
stack, through faulthandler), forked or a new process, then killed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forks

SCRIPT = """
import threading, time
def stuck_in_the_thread():
    time.sleep(120)
def stuck_in_main():
    time.sleep(120)
threading.Thread(target=stuck_in_the_thread, daemon=True).start()
stuck_in_main()
"""


@pytest.mark.parametrize("forked", ["1", "0"])
def test_a_hung_launch_is_shown_with_its_stacks_and_killed(
    forked: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNBROKEN_TEST_FORKS", forked)
    script = tmp_path / "hangs.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(forks.ROOT)}
    launch = forks.start(script, [], env)
    assert isinstance(launch.proc, subprocess.Popen) == (forked == "0"), sys.executable
    with pytest.raises(forks.Hung) as hung:
        launch.wait(timeout=4)
    text = hung.value.text
    assert "in stuck_in_main" in text and "in stuck_in_the_thread" in text, text
    with pytest.raises(ProcessLookupError):
        os.kill(launch.pid, 0)
