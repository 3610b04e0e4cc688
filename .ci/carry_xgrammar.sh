#!/usr/bin/env bash
# Packs xgrammar and the packages it imports that the H200 image lacks (pydantic, pydantic-core,
# annotated-types, typing-inspection, apache-tvm-ffi; the image has transformers and torch) into
# .devwheels/xgrammar-<version>-cp312.tar.xz, which .ci/h200_call.sh unpacks into /tmp/site.
# Without it test_features_cuda.py skips its structured-output test there, and the features record
# fails. The image's Python is 3.12, so these are cp312 wheels even where this machine runs another.
#
# The carry limit is 64 MiB with the tree, and CuTe DSL takes 52: the wheels as downloaded (7.2 MB)
# do not fit, so this drops what only compiling against them needs (tvm-ffi's headers and sources,
# pydantic.v1) and packs with xz at preset 9e behind its x86 filter, as the CuTe DSL archive is packed
# (3.92 MB for 0.2.9, against 4.36 MB at xz's default; Python's tarfile reads it; tvm-ffi's core
# links its testing library, so that stays).
set -euo pipefail
cd "$(dirname "$0")/.."
XGRAMMAR=${XGRAMMAR:-0.2.9}
out=.devwheels/xgrammar-$XGRAMMAR-cp312.tar.xz
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/dl" \
  "xgrammar==$XGRAMMAR" apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5
for w in "$work"/dl/*.whl; do python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$work/site"; done
rm -rf "$work"/site/tvm_ffi/{include,3rdparty,src,cython} "$work"/site/pydantic/v1
mkdir -p .devwheels
tar cf - -C "$work/site" . | xz --x86 --lzma2=preset=9e > "$out"
echo "wrote $out ($(stat -c %s "$out") bytes)"
