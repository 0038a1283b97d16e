#!/usr/bin/env bash
# Fetch, into .whl/ (ignored by git), the wheels bench/accelerator_run.sh needs on the lent GPU host and that its
# image lacks (pydantic for the job schema, google-crc32c for the shard writer): CPython 3.12, x86-64, the versions
# this checkout's .venv runs. The device host reaches no package index; the wheels travel with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python=".venv/bin/python"
packages=()
for name in pydantic pydantic-core annotated-types typing-inspection google-crc32c; do
    packages+=("$name==$("$python" -m pip show "$name" | sed -n 's/^Version: //p')")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${packages[@]}"
ls .whl
