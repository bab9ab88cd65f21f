#!/bin/bash
# ab.sh "args" bin1 bin2 ... : alternate, print min ms per binary
args="$1"; shift
declare -A best
for r in 1 2 3 4 5 6; do for b in "$@"; do
  ms=$(./$b $args | awk -v f=${FIELD:-4} '{print $f}')
  cur=${best[$b]:-99999}; best[$b]=$(python3 -c "print(min($cur,$ms))")
done; done
for b in "$@"; do echo "$b: ${best[$b]} ms ($args)"; done
