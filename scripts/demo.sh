#!/usr/bin/env bash
# The main job: train the char-level LM once uninterrupted and once while being killed, and compare.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec unbroken demo "$@"
