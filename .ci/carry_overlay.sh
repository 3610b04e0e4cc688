#!/bin/bash
# carry_overlay.sh REV [BASE]: the files of vllm/ and tools/ that REV adds or changes since BASE (its
# fork from main; default: the merge base of HEAD and REV), copied into .nb9/overlay/ (carried with
# .nb9), so that one device call can both make main's records and judge REV's code: `overlay_step`
# (.ci/h200_call.sh) runs a command over a copy of the tree with these files laid on top. Files main
# changed after the fork keep main's version; files REV deletes stay. A branch kept reachable by
# `git merge -s ours` is an ancestor of main, so it needs its BASE named (MEASURED.md gives it).
set -euo pipefail
rev=$(git rev-parse --verify "${1:?usage: .ci/carry_overlay.sh REV [BASE] (a branch to judge beside HEAD, and where it forked)}^{commit}")
base=$(git rev-parse --verify "${2:-$(git merge-base HEAD "$rev")}^{commit}")
if [ "$base" = "$rev" ]; then
  echo "carry_overlay: $1 is already in HEAD's history (kept by merge -s ours?): name the commit it forked from as BASE"
  exit 2
fi
rm -rf .nb9/overlay
mkdir -p .nb9/overlay
git diff --name-only --diff-filter=AM "$base" "$rev" -- vllm tools | while read -r f; do
  mkdir -p ".nb9/overlay/$(dirname "$f")"
  git show "$rev:$f" > ".nb9/overlay/$f"
  echo "overlay: $f"
done
echo "$rev" > .nb9/overlay/REV
deleted=$(git diff --name-only --diff-filter=D "$base" "$rev" -- vllm tools | wc -l)
(( deleted == 0 )) || echo "carry_overlay: $deleted file(s) that $rev deletes stay in the overlay's tree"
echo "carry_overlay: $(du -sk .nb9/overlay | cut -f1) KB for $rev over $base; check the carry with python3 .ci/carry_size.py .devwheels .nb9"
