#!/usr/bin/env bash
# tandem's GPU path, ready for a lent device (issue 29 item 3; docs/benchmarks.md "GPU").
#
#   tools/gpu/run.sh --wheelhouse          here: build .gpu/wheelhouse (tandem + what the image lacks)
#   tools/gpu/run.sh --dry-run [CHECK...]  here: wheelhouse into a throwaway venv over a stand-in
#                                          of the image, then every check on CPU at tiny sizes
#   tools/gpu/run.sh [CHECK...]            on the device: install the wheelhouse over the image's
#                                          torch, then the checks on cuda
#   tools/gpu/run.sh --list [--dry-run]    print the checks' commands, run nothing
#
# CHECKs, in order (default: all): deps train-sync gpu-tests quickstart bench-trainer
# bench-weights bench-explorer. A device call runs at most 10 minutes, so the GPU run is two calls
# (the device tool's run, carry [".gpu/wheelhouse"]), each well inside it:
#   tools/gpu/run.sh deps train-sync gpu-tests quickstart
#   tools/gpu/run.sh bench-trainer bench-weights bench-explorer
# Results: one JSON file per check and run.log under $OUT (the device tool brings $OUT back),
# or under .gpu/results (.gpu/dry-run for --dry-run) where $OUT is unset.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
HOUSE=.gpu/wheelhouse
ALL=(deps train-sync gpu-tests quickstart bench-trainer bench-weights bench-explorer)
MODE=gpu LIST=0 CHECKS=()
for arg in "$@"; do
  case $arg in
    --dry-run) MODE=dry ;;
    --wheelhouse) MODE=wheelhouse ;;
    --list) LIST=1 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) [[ " ${ALL[*]} " == *" $arg "* ]] || { echo "run.sh: unknown check $arg; one of: ${ALL[*]}" >&2; exit 2; }
       CHECKS+=("$arg") ;;
  esac
done
[ ${#CHECKS[@]} -gt 0 ] || CHECKS=("${ALL[@]}")

# The commands, once for both modes: only the device and the sizes differ.
if [ $MODE = gpu ]; then
  DEV=cuda RES=${OUT:-.gpu/results}
  QUICK=""                                                # the full quickstart: 150 GRPO steps
  BT05="--models 0.5b-shaped --layers 24 --scale 8"       # Qwen2.5-0.5B, real depth
  BT15="--models 1.5b-shaped --layers 28 --scale 8"       # Qwen2.5-1.5B, real depth
  BW="--params 494032768 --repeat 3"                      # 0.5B params, bf16 (about 1 GB)
  BE="--model .gpu/models/0.5b-shaped --batches 1,8,64 --max-tokens 64 --repeats 3 --threads 4"
  SHAPE="--shape 0.5b-shaped --layers 24"
else
  DEV=cpu RES=${OUT:-.gpu/dry-run}
  QUICK="--steps 2 --sft-steps 2"
  BT05="--models tiny --steps 1 --rounds 1"
  BT15="--models tiny --steps 1 --rounds 1 --parallel fsdp"
  BW="--params 2000000 --repeat 1"
  BE="--model .gpu/models/0.5b-shaped --batches 1,2 --max-tokens 4 --repeats 1"
  SHAPE="--shape 0.5b-shaped --layers 1"
fi

commands() {  # CHECK -> its command lines, PY and BIN left for the caller
  case $1 in
    deps) echo "\$PY tools/gpu/checks.py deps --out $RES/deps.json" ;;
    train-sync) echo "\$PY tools/gpu/checks.py train-sync --device $DEV --out $RES/train_sync.json" ;;
    gpu-tests) echo "\$PY -m pytest -m gpu -q -p no:cacheprovider tests/trainer/test_learner.py tests/weights/test_vllm.py" ;;
    quickstart) echo "\$BIN/tandem quickstart --device $DEV --plain --run-dir .gpu/runs/quickstart $QUICK"
                echo "cp .gpu/runs/quickstart/result.json $RES/quickstart.json" ;;
    bench-trainer) echo "\$PY tools/bench_trainer.py --device $DEV $BT05 --out $RES/trainer_0.5b.json"
                   echo "\$PY tools/bench_trainer.py --device $DEV $BT15 --out $RES/trainer_1.5b.json" ;;
    bench-weights) echo "\$PY tools/bench_weights.py --device $DEV $BW --out $RES/weights.json" ;;
    bench-explorer) echo "\$PY tools/gpu/checks.py build-model $SHAPE --dest .gpu/models/0.5b-shaped"
                    echo "\$PY tools/bench_explorer.py --device $DEV $BE --out $RES/explorer.json" ;;
  esac
}

if [ $LIST = 1 ]; then
  for c in "${CHECKS[@]}"; do commands "$c"; done
  exit 0
fi

build_wheelhouse() {
  # tandem's venv holds the versions its tests pass on; the image lacks these (wheelhouse.py)
  local py=.venv/bin/python
  [ -x $py ] || { echo "run.sh: no .venv here; run make install first" >&2; exit 1; }
  rm -rf $HOUSE && mkdir -p $HOUSE
  $py tools/gpu/wheelhouse.py needs > $HOUSE/requirements.txt
  # the device's Python is 3.12 (binary wheels for it), this venv's is the dry run's
  local here
  here=$($py -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  for v in 312 "$here"; do
    $py -m pip download -q --no-deps --only-binary=:all: -d $HOUSE --python-version "$v" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -r $HOUSE/requirements.txt
  done
  # tandem itself, built from this checkout (hatchling from the venv: no index needed)
  $py -m pip wheel -q --no-deps --no-build-isolation -w $HOUSE packages/*/
  for p in packages/*/; do
    $py -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["name"])' \
      "$p/pyproject.toml"
  done >> $HOUSE/requirements.txt
  echo "wheelhouse: $(ls $HOUSE/*.whl | wc -l) wheels, $(du -sh $HOUSE | cut -f1) in $HOUSE"
}

install_wheelhouse() {  # $1: python; tandem and the missing wheels, never a torch
  [ -f $HOUSE/requirements.txt ] || { echo "run.sh: no $HOUSE; build it here with tools/gpu/run.sh --wheelhouse and carry it" >&2; exit 1; }
  "$1" -m pip install -q --no-index --no-deps --no-compile --find-links $HOUSE -r $HOUSE/requirements.txt
}

case $MODE in
  wheelhouse) build_wheelhouse; exit 0 ;;
  dry)
    build_wheelhouse
    ENV=$(mktemp -d /tmp/tandem-gpu-dry.XXXXXX)
    trap 'rm -rf "$ENV"' EXIT
    .venv/bin/python -m venv "$ENV/venv"
    # the stand-in image: this venv's copies of the image's packages (torch, transformers ...)
    .venv/bin/python tools/gpu/wheelhouse.py image-view "$ENV/image" >/dev/null
    site=$("$ENV/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$ENV/image" > "$site/zz-image.pth"
    PY=$ENV/venv/bin/python BIN=$ENV/venv/bin
    install_wheelhouse "$PY" ;;
  gpu)
    PY=$(command -v python3) BIN=$(dirname "$PY")
    "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 1
    install_wheelhouse "$PY" ;;
esac

mkdir -p "$RES" .gpu/runs
LOG=$RES/run.log
: > "$LOG"
echo "mode $MODE, python $PY, checks: ${CHECKS[*]}" | tee -a "$LOG"
failed=()
for c in "${CHECKS[@]}"; do
  start=$SECONDS
  ok=1
  while IFS= read -r line; do
    cmd=${line//\$PY/$PY}; cmd=${cmd//\$BIN/$BIN}
    echo "+ $cmd" | tee -a "$LOG"
    if ! (set -o pipefail; PYTHONUNBUFFERED=1 bash -c "$cmd" 2>&1 | tee -a "$LOG"); then
      ok=0; break
    fi
  done < <(commands "$c")
  [ $ok = 1 ] || failed+=("$c")
  echo "== $c: $([ $ok = 1 ] && echo ok || echo FAILED) in $((SECONDS - start)) s" | tee -a "$LOG"
done
[ ${#failed[@]} = 0 ] || { echo "run.sh: failed: ${failed[*]} (see $LOG)" | tee -a "$LOG"; exit 1; }
echo "run.sh: all ${#CHECKS[@]} checks passed ($MODE); results in $RES" | tee -a "$LOG"
