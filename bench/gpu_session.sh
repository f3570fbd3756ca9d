#!/usr/bin/env bash
# The GPU session: one prepared command of at most 9 minutes on a lent GPU host (the development
# workplace's nvidia-h200: Python 3.12, torch 2.11, no network).
#
# The lead's call of the device tool (fetch the wheels here first: bash bench/gpu_session.sh --fetch-wheels):
#   run(command="bash bench/gpu_session.sh", carry=["bench/wheels"], timeout_s=570)
# Rerun chosen phases with what is left:  bash bench/gpu_session.sh --only probes,bigmodel --budget 240
# (the wheels phase runs always: a later call usually gets a fresh machine)
#
# Phases, each under its own `timeout`, the next one run whatever the last gave:
#   wheels    install bench/wheels offline into a site folder the sandbox can read; PRISM from src/
#   facts     nvidia-smi, torch/CUDA, capability, driver, Python, disk, memory, cgroup, imports, corpus
#   children  the jailed CUDA check child; the example and its variant cuda-count with the
#             held-out stage and the audit on (their children start CUDA under the sandbox)
#   probes    the example's variants bf16-cast, autocast-loop, compile (bench/variants.py): small runs
#   smoke     bench/gpu_smoke.py: the example against the bare loop, the bf16 bundle with held-out
#   bigmodel  bench/bundles/gpt2-100m (~100M parameters) against bench/bare_loop.py, bf16 then fp32
# Logs and summary.json go to $OUT (a temporary folder when unset): session.log, summary.json and
# one log per phase (8 files: the device tool brings back 8 at most). Exit status 0 when every
# phase is ok. --dry-run: every phase on the CPU with small sizes (no GPU needed; the CI test
# tests/test_gpu_session.py runs it).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY=0; ONLY=""; BUDGET=""; FETCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) ONLY="$2"; shift ;;
    --budget) BUDGET="$2"; shift ;;
    --fetch-wheels) FETCH=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_session.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PRISM_PYTHON:-python3}
WHEELS=${PRISM_WHEELS:-$REPO/bench/wheels}
LIST="$REPO/bench/gpu_wheels.txt"

if [ "$FETCH" = 1 ]; then  # here, with network: the wheels the device image lacks, for its Python
  mkdir -p "$WHEELS" && echo '*' > "$WHEELS/.gitignore"
  for v in ${PRISM_WHEEL_PYTHONS:-3.12}; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" -r "$LIST" || exit 1
  done
  du -sh "$WHEELS"; exit 0
fi

OUT=${OUT:-$(mktemp -d /tmp/prism-gpu-session.XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/prism-gpu-session-work.XXXXXX)
# each phase's limit in seconds (never past the budget): on the GPU they add up to the 540 s budget
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; SMOKE_SIZE=--quick; THREADS=1; BUDGET=${BUDGET:-900}
  declare -A CAP=([wheels]=60 [facts]=60 [children]=150 [probes]=180 [smoke]=180 [bigmodel]=150)
else
  DEVICE=cuda; SMOKE_SIZE=; THREADS=2; BUDGET=${BUDGET:-540}
  declare -A CAP=([wheels]=30 [facts]=45 [children]=75 [probes]=120 [smoke]=105 [bigmodel]=165)
fi
START=$(date +%s); END=$((START + BUDGET))
exec > >(tee -a "$OUT/session.log") 2>&1
echo "== GPU session: device $DEVICE, dry run $DRY, budget ${BUDGET} s, OUT $OUT, python $(command -v "$PY")"

wanted() { [ -z "$ONLY" ] || [ "$1" = wheels ] || [[ ",$ONLY," == *",$1,"* ]]; }  # a fresh machine needs the wheels

# limit NAME: the phase's limit, or what is left of the budget if less
limit() { local left=$((END - $(date +%s) - 5)) cap=${CAP[$1]}; echo $(( left < cap ? left : cap )); }

# run_phase NAME CMD...: CMD under `timeout` (its limit), its output in $OUT/NAME.log and here;
# "rc seconds limit" in $WORK/NAME.rc for the summary.
run_phase() {
  local name=$1; shift
  wanted "$name" || { echo "not asked for (--only $ONLY)" > "$WORK/$name.note"; return; }
  local limit; limit=$(limit "$name")
  if [ "$limit" -lt 10 ]; then echo "no time left in the budget of ${BUDGET} s" > "$WORK/$name.note"; return; fi
  echo; echo "== phase $name (limit ${limit} s)"
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$rc $(( $(date +%s) - t0 )) $limit" > "$WORK/$name.rc"
  echo "== phase $name: exit $rc after $(( $(date +%s) - t0 )) s"
}

install_wheels() {  # the wheels the image lacks, offline; on a dry run, checked against the device's tags
  if [ ! -d "$WHEELS" ] || ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    [ "$DRY" = 1 ] && { echo "no bench/wheels here: nothing to check (a dry run uses this Python's packages)"; return 0; }
    echo "bench/wheels is missing: run 'bash bench/gpu_session.sh --fetch-wheels' here and carry bench/wheels"; return 1
  fi
  if [ "$DRY" = 1 ]; then  # would they install on the device (Python 3.12, manylinux x86_64)?
    "$PY" -m pip install -q --no-index --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --find-links "$WHEELS" -r "$LIST" \
      --target "$WORK/site-check" && echo "every pinned wheel installs for cp312 manylinux x86_64"
    return
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" \
    --find-links "$WHEELS" -r "$LIST" \
    && echo "installed into $SITE: $(ls "$SITE" | grep -c dist-info) distributions"
}
export -f install_wheels
export PY WHEELS LIST WORK DRY

# The ranks run as an unprivileged uid when the session is root: they must read PRISM's source.
world_readable() {  # every folder from / down to $1 lets others through
  local p=$1
  while [ "$p" != / ]; do [[ $(stat -c %A "$p") == *[xt] ]] || return 1; p=$(dirname "$p"); done
}
if [ "$(id -u)" = 0 ] && [ "$DRY" = 0 ] && ! world_readable "$REPO"; then
  COPY=/opt/prism-session/repo; rm -rf "$COPY"; mkdir -p "$COPY"
  (cd "$REPO" && tar --exclude=./.git --exclude=./bench/wheels -cf - .) | (cd "$COPY" && tar -xf -)
  chmod -R a+rX /opt/prism-session; echo "the checkout at $REPO is not world-readable: running from a copy at $COPY"
  REPO_RUN=$COPY
else
  REPO_RUN=$REPO
fi
# the wheels' site folder: outside /tmp (the sandbox's /tmp is its own), readable by the ranks' uid
SITE=${PRISM_SITE:-$HOME/.cache/prism-session-site}
[ "$DRY" = 0 ] && [ "$(id -u)" = 0 ] && SITE=${PRISM_SITE:-/opt/prism-site}
export SITE
cd "$REPO_RUN" || exit 1
run_phase wheels bash -c install_wheels
export PYTHONPATH="$REPO_RUN/src${PYTHONPATH:+:$PYTHONPATH}"  # PRISM itself, from its source
[ "$DRY" = 0 ] && export PYTHONPATH="$SITE:$PYTHONPATH"
export PYTHONUNBUFFERED=1
DRYFLAG=$([ "$DRY" = 1 ] && echo --dry-run)
phase() {  # phase NAME: bench/session_phases.py NAME, told to end 5 s before its limit
  run_phase "$1" "$PY" bench/session_phases.py "$1" --device "$DEVICE" $DRYFLAG --threads "$THREADS" \
    --budget-s $(( $(limit "$1") - 5 )) --result "$WORK/$1.json"
}
phase facts
phase children
phase probes
SMOKE_S=$(( $(limit smoke) - 5 ))
run_phase smoke "$PY" bench/gpu_smoke.py --device "$DEVICE" $SMOKE_SIZE --threads "$THREADS" --deadline "$SMOKE_S" \
  --part-timeout $(( SMOKE_S / 2 )) --only overhead,bf16 --overhead-cases example --repeats 1 --json "$WORK/smoke.json"
phase bigmodel
"$PY" bench/session_summary.py "$WORK" "$OUT" "$DRY" "$DEVICE" || true
rc=$("$PY" -c "import json,sys; print(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$OUT/summary.json" \
  2>/dev/null || echo 1)
echo "== $(( $(date +%s) - START )) s in all; logs and summary.json in $OUT"
rm -rf "$WORK"
exit "$rc"
