#!/usr/bin/env bash
# Re-measure the speed table on one GPU machine, in one command.
#
#   bash scripts/gpu_check.sh --prepare [REF]     # beforehand, in a checkout (default REF: main)
#   bash scripts/gpu_check.sh [options]           # on the GPU machine, carrying .gpu
#
# --prepare runs the GPU kit's prepare.sh (the folder $GPU_KIT, default
# ../shared/gpu beside the checkout), which puts fairseq and fairscale wheels
# and the compiled minimal GPT in .gpu/, git-ignored; it exports REF's tree to
# .gpu/base so that the same run can time that code next to the working
# tree's. pytest's wheels go to .gpu/extra for --cuda-tests.
#
# The run times, back to back on one machine and for each --shape: the
# compiled minimal GPT (.gpu/sdpa_gpt_anchor.py), the code in .gpu/base, and
# the working tree's, each with scripts/benchmark.py (fairseq-train's wps,
# median of the last three log intervals). It writes to $OUT (default
# /tmp/gpu_check_out): gpu_check.csv and gpu_check.png (every row), with
# --profile a torch.profiler kernel table per implementation, and
# gpu_check.log, a copy of what it prints, including how long each part took.
#
# Options:
#   --shape S        1p3b (default), 350m, 11b_8layers or tiny (tiny runs on a
#                    CPU: no GPT, fp32, no compilation; it checks this script)
#   --with-11b       also --shape 11b_8layers
#   --updates N      updates per fairseq-train run (default 40, log every 10)
#   --profile        profile 5 steps of each implementation (a slower last
#                    interval for each, alike)
#   --no-gpt, --no-base, --no-tree
#                    leave that implementation out
#   --fully-sharded  also time the working tree under --ddp-backend fully_sharded
#                    (torch's FSDP2 at data-parallel size 1), and print the memory
#                    report of it and of the tree's pytorch_ddp run
#   --cuda-tests     then run tests/gpu/test_cuda.py (needs .gpu/extra's pytest)
#   --label TEXT     appended to every row's label
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

if [ "${1:-}" = "--prepare" ]; then
    ref="${2:-main}"
    bash "${GPU_KIT:-../shared/gpu}/prepare.sh"
    rm -rf .gpu/base && mkdir -p .gpu/base
    git archive "$ref" | tar -x -C .gpu/base
    echo "base: $ref = $(git rev-parse --short "$ref") in .gpu/base"
    if [ ! -d .gpu/extra ]; then
        python3 -m pip download -q --no-deps -d .gpu/extra pytest pluggy iniconfig packaging pygments
    fi
    du -sh .gpu
    exit 0
fi

shapes=()
updates=40
profile=0
gpt=1
base=1
tree=1
cuda_tests=0
fully_sharded=0
label=""
while [ $# -gt 0 ]; do
    case "$1" in
        --shape) shapes+=("$2"); shift 2 ;;
        --with-11b) shapes+=(11b_8layers); shift ;;
        --updates) updates="$2"; shift 2 ;;
        --profile) profile=1; shift ;;
        --no-gpt) gpt=0; shift ;;
        --no-base) base=0; shift ;;
        --no-tree) tree=0; shift ;;
        --cuda-tests) cuda_tests=1; shift ;;
        --fully-sharded) fully_sharded=1; shift ;;
        --label) label="$2"; shift 2 ;;
        *) echo "error: unknown option $1 (see the head of $0)" >&2; exit 2 ;;
    esac
done
[ ${#shapes[@]} -gt 0 ] || shapes=(1p3b)
if [ $profile = 1 ] && [ "$updates" -lt 70 ]; then
    updates=70  # the profiled steps 30-34 then lie before the last three 10-update intervals
fi
if [ "${shapes[0]}" = 1p3b ] && [ ${#shapes[@]} -gt 1 ] && [ "${shapes[1]}" = 1p3b ]; then
    shapes=("${shapes[@]:1}")
fi

OUT="${OUT:-/tmp/gpu_check_out}"
work=/tmp/gpu_check_work
mkdir -p "$OUT" "$work"
log="$OUT/gpu_check.log"
exec > >(tee -a "$log") 2>&1

start=$(date +%s)
part_start=$start
part() {  # part NAME: print how long the part that ends here took (and the GPU's clocks under load)
    local now
    now=$(date +%s)
    echo "== $1: $((now - part_start)) s (total $((now - start)) s)$(loaded_clocks "$part_start" "$now")"
    part_start=$now
}
loaded_clocks() {  # loaded_clocks FROM TO: mean SM clock and power of the samples above half the power limit
    [ -f "${clocks:-}" ] || return 0
    python3 - "$clocks" "$1" "$2" "${power_limit:-0}" <<'PY'
import csv, sys
path, start, end, limit = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rows = [r for r in csv.DictReader(open(path)) if start <= float(r["time"]) <= end]
try:
    loaded = [r for r in rows if float(r["power_w"]) > limit / 2]
except ValueError:
    loaded = []
if loaded:
    mean = lambda k: sum(float(r[k]) for r in loaded) / len(loaded)
    print(f"; under load {len(loaded) / 2:.0f} s at {mean('sm_mhz'):.0f} MHz, {mean('power_w'):.0f} W, "
          f"{max(float(r['temp_c']) for r in loaded):.0f} C max", end="")
PY
}

if ! python3 -c "import fairseq" 2>/dev/null; then
    [ -f .gpu/setup.sh ] || { echo "error: no fairseq here and no .gpu/setup.sh: run '$0 --prepare' first" >&2; exit 1; }
    # shellcheck disable=SC1091
    source .gpu/setup.sh
fi
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
if [ $base = 1 ] && [ ! -f .gpu/base/scripts/benchmark.py ]; then
    echo "error: no .gpu/base: run '$0 --prepare' first (or pass --no-base)" >&2
    exit 1
fi
gpu=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$gpu" = 0 ] && [ $profile = 1 ]; then
    echo "no GPU: --profile left out (it tables device kernels)"
    profile=0
fi
clocks="$OUT/gpu_clocks.csv"
if [ "$gpu" = 1 ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader
    power_limit=$(nvidia-smi --query-gpu=power.limit --format=csv,noheader,nounits | head -1 | tr -d ' ')
    # SM clock, power and temperature twice a second: kernels of one implementation can
    # only be compared with another's at the same clocks (power capping, heat)
    echo "time,sm_mhz,power_w,temp_c" > "$clocks"
    (while sleep 0.5; do
        echo "$(date +%s.%N),$(nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu \
            --format=csv,noheader,nounits | tr -d ' ')"
    done >> "$clocks") &
    sampler=$!
    trap 'kill $sampler 2>/dev/null || true' EXIT
fi
part setup

csv="$OUT/gpu_check.csv"
png="$OUT/gpu_check.png"

run() {  # run IMPL ROOT SHAPE [benchmark.py flags...]: one implementation, from its own checkout
    local impl=$1 from=$2 shape=$3
    shift 3
    local flags=(--shape "$shape" --updates "$updates" --log-interval $((updates / 4 > 10 ? 10 : updates / 4))
                 --work-dir "$work" --csv "$csv" --png "$png")
    if [ "$gpu" = 1 ]; then
        flags+=(--precision bf16-autocast --compile-layers)
        [ "$impl" = sharded ] || flags+=(--cuda-graphs)  # refused under fully_sharded: FSDP2's collectives
    else
        flags+=(--precision fp32)
    fi
    local env=()
    if [ $profile = 1 ]; then  # steps 30-34 (the GPT: warm-up steps 3-5), before the timed intervals
        env=(FAIRSEQ_MEGATRON_PROFILE="$work/profile-$impl-$shape.txt")
    fi
    # From the checkout's root, so that its own package is the one imported.
    (cd "$from" && env PYTHONPATH="$from:${PYTHONPATH:-}" "${env[@]}" \
        python3 scripts/benchmark.py "${flags[@]}" --label "$impl${label:+ $label}" "$@")
    if [ $profile = 1 ]; then
        for table in "$work"/profile-"$impl"-"$shape"-*.txt; do
            [ -f "$table" ] && cp "$table" "$OUT/"
        done
    fi
    part "$impl $shape"
}

for shape in "${shapes[@]}"; do
    if [ $gpt = 1 ] && [ "$gpu" = 1 ]; then
        run gpt "$root" "$shape" --only-anchor --with-anchor "$root/.gpu/sdpa_gpt_anchor.py"
    fi
    [ $base = 1 ] && run base "$root/.gpu/base" "$shape"
    if [ $tree = 1 ]; then
        run tree "$root" "$shape"
        grep -ho "memory of rank.*" "$work/megatron-$shape-mp1.log" | sed 's/^/tree pytorch_ddp: /' || true
    fi
    if [ $fully_sharded = 1 ]; then
        run sharded "$root" "$shape" --extra="--ddp-backend fully_sharded"
        grep -ho "memory of rank.*" "$work/megatron-$shape-mp1.log" | sed 's/^/tree fully_sharded: /' || true
    fi
done

[ -f "$csv" ] && python3 - "$csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
    words = r["label"].split()
    impl = ("gpt" if r["impl"] == "anchor" else "base" if "base" in words else "tree" if "tree" in words
            else "sharded" if "sharded" in words else None)
    if impl:
        by.setdefault(r["shape"], {})[impl] = float(r["tokens_per_s"])
for shape, t in by.items():
    parts = [f"{k} {v / 1e3:.1f}k" for k, v in t.items()]
    ratios = [f"{a}/{b} {t[a] / t[b]:.3f}" for a, b in (("tree", "base"), ("tree", "gpt"), ("base", "gpt"),
                                                         ("sharded", "tree"))
              if a in t and b in t]
    print(f"{shape}: tokens/s {', '.join(parts)}; {', '.join(ratios)}")
PY
part summary

if [ $cuda_tests = 1 ]; then
    if ! python3 -m pytest --version >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/extra/*.whl
    fi
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py || echo "test_cuda: FAILED"
    part "tests/gpu/test_cuda.py"
fi
