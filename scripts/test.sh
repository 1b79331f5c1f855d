#!/usr/bin/env bash
# Every check: ruff (format + lint), mypy on the package, then the test suite.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ruff format --check unbroken tests examples bench
ruff check unbroken tests examples bench
mypy unbroken
exec python -m pytest -q "$@"
