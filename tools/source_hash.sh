#!/usr/bin/env bash
# One hash of the files that make the extension and its tests (csrc, flash_ext, tests, setup.py,
# build_support/): the same in a checkout and in the copy of it that the GPU machine runs, whatever
# git metadata came along. Usage: bash tools/source_hash.sh  (prints the first 12 hex digits)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
find csrc flash_ext tests setup.py build_support -type f \
    \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cpp' -o -name '*.py' \) \
    -not -path "*/__pycache__/*" \
  | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
