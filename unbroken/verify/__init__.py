"""Verify layer: does a training command, interrupted and relaunched, end bit for bit like an
uninterrupted run? (``unbroken verify``; ``unbroken.verify_resume`` for a test suite.)

    verify_resume(cmd)   run cmd straight through, then interrupted K times (moments from
                         _plan) and relaunched (_runner), and compare the two run
                         directories (_compare, in a child of the fork server: _compare_job);
                         the verdict and its hints (_report)
    compare_runs(a, b)   the comparison alone, on two existing run directories
"""

from typing import TYPE_CHECKING

from .. import _lazy
from ._findings import Comparison, Difference
from ._plan import Target, plan_interrupts
from ._report import Interruption, VerifyReport
from ._runner import PLACEHOLDER, verify_resume
from ._unverifiable import ScriptFailedError, VerifyError
from ._volatile import VOLATILE

if TYPE_CHECKING:
    from ._compare import compare_runs

# compare_runs imports torch; `unbroken verify` itself need not (the comparison runs in a child
# of the fork server that imported it already).
__getattr__, __dir__ = _lazy.exports(__name__, {"compare_runs": "._compare"})

__all__ = [
    "PLACEHOLDER",
    "VOLATILE",
    "Comparison",
    "Difference",
    "Interruption",
    "ScriptFailedError",
    "Target",
    "VerifyError",
    "VerifyReport",
    "compare_runs",
    "plan_interrupts",
    "verify_resume",
]
