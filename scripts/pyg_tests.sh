#!/usr/bin/env bash
# Lays out PyG's own test files for tests/test_pyg_suite.py, from a clone of PyG's repository at
# the tag the suite is pinned to: the layer tests, the auto-encoder tests, the explain tests and
# their conftests, under DEST/test/ (default tests/pyg/upstream, where .gitignore keeps them out of
# the repository; PyG's LICENSE is already there).
#
#   scripts/pyg_tests.sh PYG_GIT_DIR [DEST]
set -euo pipefail
git_dir=${1:?the git directory of a clone of pytorch_geometric}
dest=${2:-$(dirname "$0")/../tests/pyg/upstream}
tag=${PYG_TAG:-2.8.0.post1}
mkdir -p "$dest"
git --git-dir="$git_dir" archive "$tag" test/conftest.py test/explain test/nn/conv/test_transformer_conv.py \
  test/nn/conv/test_gat_conv.py test/nn/conv/test_gatv2_conv.py test/nn/conv/test_agnn_conv.py \
  test/nn/models/test_autoencoder.py LICENSE | tar -x -C "$dest"
echo "PyG $tag tests under $dest/test"
