#!/usr/bin/env bash
# The rollout of two trees timed alternately on one GPU (base, this, base, this, ...), each run its own process:
# rollout times differ by a few percent from process to process, so one run of each cannot tell a small change from noise.
# Each run is `decode_gaps.py --sync-every 16 --repeats 3 --no-profile` (default engine, grpo-0.5b shape, best of 3).
#   mkdir -p benchmarks/_base && git archive BASE_COMMIT hybridrl | tar -x -C benchmarks/_base   # untracked: carried
#   OUT=/tmp/out bash benchmarks/profiling/rollout_ab.sh benchmarks/_base [rounds, default 3]
# Delete benchmarks/_base before committing. Logs go to $OUT/ab_<tree>_<round>.log.
set -u -o pipefail
base=${1:?"give the directory holding the base tree's hybridrl/ package"}
rounds=${2:-3}
OUT=${OUT:-/tmp/hybridrl-ab}; mkdir -p "$OUT"
[ -d "$base/hybridrl" ] || { echo "no $base/hybridrl: see the usage at the top of $0"; exit 2; }
base=$(cd "$base" && pwd)
root=$PWD
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
declare -A seconds
for round in $(seq 1 "$rounds"); do
    for tree in base this; do
        path=$root; [ "$tree" = base ] && path=$base:$root
        # From $OUT, not the checkout: `python -m` puts its working directory first on sys.path, which would
        # shadow the base tree's hybridrl/ with this one's.
        (cd "$OUT" && PYTHONPATH=$path timeout -k 20 150 python3 -m benchmarks.profiling.decode_gaps --sync-every 16 \
            --repeats 3 --no-profile > "ab_${tree}_${round}.log" 2>&1)
        seconds[$tree]="${seconds[$tree]:-} $(awk '/^sync_every 16:/ {print $3}' "$OUT/ab_${tree}_${round}.log")"
        echo "round $round $tree: $(grep '^sync_every 16:' "$OUT/ab_${tree}_${round}.log")"
    done
done
echo "rollout s, best of 3 per process, in run order:"
echo "  base:${seconds[base]}"
echo "  this:${seconds[this]}"
