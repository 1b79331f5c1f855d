"""Verify layer: does a training command, interrupted and relaunched, end bit for bit like an
uninterrupted run? (``unbroken verify``; ``unbroken.verify_resume`` for a test suite.)

    verify_resume(cmd)   run cmd straight through, then interrupted K times (moments from
                         _plan) and relaunched (_runner), and compare the two run
                         directories (_compare); the verdict and its hints (_report)
    compare_runs(a, b)   the comparison alone, on two existing run directories
"""

from ._compare import VOLATILE, Comparison, Difference, compare_runs
from ._plan import Target, plan_interrupts
from ._report import Interruption, VerifyReport
from ._runner import PLACEHOLDER, verify_resume
from ._unverifiable import ScriptFailedError, VerifyError

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
