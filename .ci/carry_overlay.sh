#!/bin/bash
# carry_overlay.sh REV: the files of vllm/ and tools/ that REV adds or changes against HEAD, copied
# into .nb9/overlay/ (carried with .nb9), so that one device call can both make main's records
# and judge REV's code: `overlay_step` (.ci/h200_call.sh) runs a command over a copy of the tree
# with these files laid on top. Files REV deletes stay; judge such a branch by checking it out.
set -euo pipefail
rev=$(git rev-parse --verify "${1:?usage: .ci/carry_overlay.sh REV (a branch or commit to judge beside HEAD)}^{commit}")
rm -rf .nb9/overlay
mkdir -p .nb9/overlay
git diff --name-only --diff-filter=AM HEAD "$rev" -- vllm tools | while read -r f; do
  mkdir -p ".nb9/overlay/$(dirname "$f")"
  git show "$rev:$f" > ".nb9/overlay/$f"
  echo "overlay: $f"
done
echo "$rev" > .nb9/overlay/REV
deleted=$(git diff --name-only --diff-filter=D HEAD "$rev" -- vllm tools | wc -l)
(( deleted == 0 )) || echo "carry_overlay: $deleted file(s) that $rev deletes stay in the overlay's tree"
echo "carry_overlay: $(du -sk .nb9/overlay | cut -f1) KB for $rev; check the carry with python3 .ci/carry_size.py .devwheels .nb9"
