#!/usr/bin/env bash
# Every check: ruff (format + lint), mypy on the package, then the test suite.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ruff format --check unbroken tests examples bench
ruff check unbroken tests examples bench
mypy unbroken
# Two workers, one test file each at a time (module fixtures run once; a file's end-to-end runs
# stay in order): about half the wall time on 2 cores. UNBROKEN_TEST_WORKERS=0 runs in-process.
if [ "${1:-}" = "--fast" ]; then
    # The fast tier: tests/unit, in-process only, about a minute.
    shift
    exec python -m pytest -q tests/unit "$@"
fi
exec python -m pytest -q -n "${UNBROKEN_TEST_WORKERS:-2}" --dist loadfile --durations=30 "$@"
