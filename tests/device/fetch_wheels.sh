#!/usr/bin/env bash
# Run HERE (a machine with network), from the repo root, before the GPU run: downloads into .whl/
# (git-ignored) the pure-Python wheels `import neuronfx` needs that the GPU machine's image lacks
# (cattrs, gguf) and the attrs that this cattrs needs (the image's may be older). About 0.3 MiB.
set -euo pipefail
PY=${PYTHON:-python3}
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
rm -f .whl/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "cattrs==$(ver cattrs)" "gguf==$(ver gguf)" "attrs==$(ver attrs)"
ls -l .whl
