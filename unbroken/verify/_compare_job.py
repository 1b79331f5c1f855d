"""The comparison of a verify, run in a child of the fork server (which imported torch already):
``python -m unbroken.verify._compare_job JOB.json`` reads ``{"ref", "other", "atol", "rtol",
"ignore", "out"}`` and writes ``{"comparison": ...}`` (:func:`._findings.comparison_to_json`) or
``{"error": TEXT}`` (the comparison could not be made: a VerifyError) to ``out``. Anything else
it leaves unwritten, and verify compares in its own process (_runner)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main(job_path: str) -> None:
    from ._compare import compare_runs
    from ._findings import comparison_to_json
    from ._unverifiable import VerifyError

    with open(job_path) as f:
        job = json.load(f)
    try:
        cmp = compare_runs(
            job["ref"], job["other"], atol=job["atol"], rtol=job["rtol"], ignore=job["ignore"]
        )
        result: dict[str, Any] = {"comparison": comparison_to_json(cmp)}
    except VerifyError as e:
        result = {"error": str(e)}
    tmp = job["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
