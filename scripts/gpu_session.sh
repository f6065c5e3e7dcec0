#!/usr/bin/env bash
# The GPU work of a session on the lent H200 machine(s), in stages, each writing under $OUT:
#   bash scripts/gpu_session.sh STAGE [STAGE ...]
# Stages: env, triton-selftest, tlx-selftest, premerge:GPUS:BACKENDS:TAG[:CPUS], bench, tune:ROLES,
# sanitizer:TOOL:BACKEND[:i/n], repeat[:BACKEND[:RUNS]], fuzz:BACKEND[:SECONDS], ab:BASE, scaling[:BACKENDS]. A group STAGE+STAGE+... runs its stages
# at once, the i-th on GPU i mod (the GPUs present), e.g. the shards of a sanitizer run spread over a
# multi-GPU machine.
# The machine has no package registry: run from the carried tree (PYTHONPATH) and carry
# fbtriton in .carry for the tlx stages (../shared/device/README.md); a stage naming the tlx backend, and
# bench's second run, run with fbtriton first on the path (it replaces triton: the triton backend then runs
# on it too).
set -uo pipefail
# The machine's Python packages come without bytecode caches it can write: every process compiled sympy,
# scipy and torch's Python from source again (sympy alone 1.9 s of each suite worker's first test). A cache
# of our own, filled by the first process, gives later ones what an ordinary installation has.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/jfa/pycache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/jfa
FBT=/tmp/fbt

# REQUIRE_CARD (e.g. H200): no stage runs unless every GPU's name contains it. A device call that names the
# H200 kind may be given an H100, and an H200 table's figures or an H200 baseline's update must not come from
# one. The cards found go to $OUT/card.txt; exit 3, or, with OTHER_CARD_STAGES (stages as on the command line,
# e.g. "repeat:tlx:500 sanitizer:memcheck:tlx"), run those instead: work whose findings hold on any card, so that
# a machine that took minutes to start is not handed back idle.
if [ -n "${REQUIRE_CARD:-}" ]; then
  cards=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1)
  if [ -z "$cards" ] || grep -v -q -F -- "$REQUIRE_CARD" <<< "$cards"; then
    found="REQUIRE_CARD=$REQUIRE_CARD, but the GPUs are: ${cards:-none}"
    if [ -z "${OTHER_CARD_STAGES:-}" ]; then
      echo "$found; no stage run" | tee "$OUT/card.txt"
      exit 3
    fi
    echo "$found; running OTHER_CARD_STAGES instead: $OTHER_CARD_STAGES" | tee "$OUT/card.txt"
    read -ra other_stages <<< "$OTHER_CARD_STAGES"
    set -- "${other_stages[@]}"
  fi
fi

with_fbtriton() {  # runs "$@" with fbtriton (Triton with TLX) first on the path
  [ -d $FBT ] || python3 -c "import tarfile; tarfile.open('.carry/fbtriton-cp312.tar.xz').extractall('$FBT')"
  PYTHONPATH=$FBT:$PWD "$@"
}

for_backends() {  # runs "$@" with fbtriton when the backends $1 include tlx
  local backends=$1; shift
  if [[ " $backends " == *" tlx "* ]]; then with_fbtriton "$@"; else "$@"; fi
}

core_share() {  # the i-th ($1) of $2 shares of this process's usable cores as a taskset list (verify.devices)
  python3 -c "from verify.devices import cpu_share, usable_cpu_list
print(','.join(map(str, cpu_share(usable_cpu_list(), $1, $2))))"
}

stage_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/env.txt"
}

stage_triton_selftest() { timeout 240 python3 -m jfa.triton.gpu_selftest --jobs 16 2>&1 | tee "$OUT/triton_selftest.txt"; }

stage_tlx_selftest() { with_fbtriton timeout 300 python3 -m jfa.tlx.gpu_selftest 2>&1 | tee "$OUT/tlx_selftest.txt"; }

# premerge GPUS "BACKENDS" TAG [CPUS]: the premerge profile (or PROFILE) on the first GPUS GPUs, WPG (4) workers
# each; wall time recorded. CPUS (a taskset list, e.g. 0-15) confines the run to those cores: one GPU's share
# of a host with several, so that a 1-GPU run there has what a 1-GPU machine has (nvidia-h200: 16 cores). In a
# group, a stage without CPUS gets the group's i-th share of the cores (GROUP_CPUS), since each run's workers
# pin themselves to slices of the cores they are given (--jfa-worker-cpus) and two runs given the same would
# put their workers on the same slices.
# RESUME=1 continues the stage's run of the same TAG that a time limit stopped (pytest's --jfa-resume);
# PYTEST_ARGS are added to pytest's (e.g. --jfa-worker-cpus all).
stage_premerge() {
  local gpus=$1 backends=$2 tag=$3 cpus=${4:-${GROUP_CPUS:-}} devices args=() confine=()
  # the first GPUS of those visible (a group stage is given its own)
  devices=$(tr , '\n' <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 15)}" | head -n "$gpus" | paste -sd,)
  for b in $backends; do args+=(--jfa-backend "$b"); done
  if [ -n "${RESUME:-}" ]; then args+=(--jfa-resume); else : > /tmp/jfa/$tag.log; fi
  [ -n "$cpus" ] && confine=(taskset -c "$cpus")
  local start=$SECONDS
  CUDA_VISIBLE_DEVICES=$devices for_backends "$backends" "${confine[@]}" timeout ${PREMERGE_TIMEOUT:-300} python3 -m pytest -n auto -q -p no:cacheprovider \
    verify/ --jfa-profile ${PROFILE:-premerge} --jfa-workers-per-gpu ${WPG:-4} "${args[@]}" ${PYTEST_ARGS:-} --jfa-results /tmp/jfa/$tag.jsonl >> /tmp/jfa/$tag.log 2>&1
  echo "premerge $tag on $gpus GPU(s)${cpus:+, cores $cpus}, backends $backends: exit $?, wall $((SECONDS - start)) s" | tee -a "$OUT/timings.txt"
  tail -n 60 /tmp/jfa/$tag.log
  # A run stopped by its time limit has not merged its worker files: keep those.
  local records
  records=$(compgen -G "/tmp/jfa/$tag.jsonl*")
  if [ -n "$records" ]; then
    python3 -m verify timeline $records > "$OUT/$tag.timeline.txt" 2>&1
    cat $records | gzip > "$OUT/$tag.jsonl.gz"
  fi
  grep -E "^(FAILED|ERROR)|crashed|INTERNALERROR" /tmp/jfa/$tag.log | head -n 80 > "$OUT/$tag.failures.txt"
}

# bench: the Triton kernels on stock triton (their own runtime) beside torch-varlen and flex in one run, then
# tlx with fbtriton first on the path (triton again there, for comparison) beside torch-varlen for its ratios
# (Inductor's generated kernels, flex's, do not load under fbtriton).
stage_bench() {
  timeout ${BENCH_TIMEOUT:-300} python3 -m jfa.bench --backends triton torch-varlen flex ${BENCH_ARGS:-} \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
  with_fbtriton timeout ${BENCH_TIMEOUT:-300} python3 -m jfa.bench --backends tlx triton torch-varlen ${BENCH_ARGS:-} \
    --json "$OUT/bench_tlx.json" 2>&1 | tee "$OUT/bench_tlx.txt"
}

# tune ROLES: python -m jfa.triton.tune over the comma-separated kernel roles (TUNE_ARGS: e.g. --head-dim 64),
# on stock triton, the backend's own; two groups of roles fit one call as a group, one GPU each.
stage_tune() {
  local roles=$1 name=tune_${1//,/_}
  timeout ${TUNE_TIMEOUT:-540} python3 -m jfa.triton.tune --roles ${roles//,/ } --iters 5 ${TUNE_ARGS:-} \
    --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "tune $roles: exit $?" | tee -a "$OUT/timings.txt"
  tail -n 60 "$OUT/$name.txt"
}

# sanitizer TOOL BACKEND [SHARD]: compute-sanitizer's TOOL (memcheck, racecheck, ...) over the smoke profile, or
# its shard i/n (racecheck slows TLX launches so much that the whole profile outlasts one device call); PYTEST_ARGS
# are added to pytest's (e.g. -k backward). memcheck and initcheck run with PyTorch's caching allocator off: it
# carves tensors out of large cudaMalloc segments, and an access past a tensor that stays inside its segment is one
# those tools cannot see (pytorch/pytorch#45294); uncached, every tensor is an allocation of its own.
stage_sanitizer() {
  local tool=$1 backend=$2 shard=${3:-0/1} uncached=()
  local name=sanitizer_${tool}_${backend}_${shard/\//of}
  [[ $tool == memcheck || $tool == initcheck ]] && uncached=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  for_backends "$backend" "${uncached[@]}" timeout ${SANITIZER_TIMEOUT:-240} compute-sanitizer --tool "$tool" \
    --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider verify/ --jfa-profile smoke --jfa-backend "$backend" --shard "$shard" \
    ${PYTEST_ARGS:-} --jfa-results /tmp/jfa/$name.jsonl > /tmp/jfa/$name.log 2>&1
  echo "$name: exit $?" | tee -a "$OUT/timings.txt"
  tail -n 40 /tmp/jfa/$name.log | tee "$OUT/$name.txt"
}

# ab BASE: the kernels of BASE (a folder of the carried tree holding another revision's jfa/, e.g. made with
# `git archive REV jfa | tar -x -C scratch/base`: the machine's git metadata may lack REV) against this tree's,
# alternating AB_ROUNDS times on AB_ROWS (scripts/ab_probe.py says what is timed; rows with the `tlx` option
# time the tlx backend, and then every side runs with fbtriton first on the path), then the summary. AB_MORE:
# candidate folders like BASE, each measured after this tree in every round as a side named by its folder's
# name and compared with BASE; AB_KERNEL: the summary compares only the kernels whose name contains it.
stage_ab() {
  local base=$1 round rows=${AB_ROWS:-gem long skew broadcast gem:causal gem:w256 long:causal} first= tree
  [[ " $rows" == *:tlx* ]] && { with_fbtriton true; first=$FBT:; }
  for tree in ${AB_MORE:-}; do
    case $(basename "$tree") in base | mine) echo "AB_MORE: $tree: a candidate's name is its side's, not base or mine"
      return 1 ;;
    esac
  done
  : > "$OUT/ab.jsonl"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    PYTHONPATH=$first$PWD/$base:$PWD timeout ${AB_TIMEOUT:-250} python3 scripts/ab_probe.py measure "base:$round" \
      "$OUT/ab.jsonl" $rows
    PYTHONPATH=$first$PWD timeout ${AB_TIMEOUT:-250} python3 scripts/ab_probe.py measure "mine:$round" \
      "$OUT/ab.jsonl" $rows
    for tree in ${AB_MORE:-}; do
      PYTHONPATH=$first$PWD/$tree:$PWD timeout ${AB_TIMEOUT:-250} python3 scripts/ab_probe.py measure \
        "$(basename "$tree"):$round" "$OUT/ab.jsonl" $rows
    done
  done
  python3 scripts/ab_probe.py summary "$OUT/ab.jsonl" ${AB_KERNEL:+--kernel "$AB_KERNEL"} | tee "$OUT/ab.txt"
}

# scaling [BACKENDS]: the premerge profile once on every GPU (compiling the Triton kernels into the cache), then
# timed on one GPU with its share of the cores (as a one-GPU machine has them) and on every GPU; prints both
# runs' `verify timeline` run lines, the wall ratio, and `verify same` of the two runs' records. SCALE_TAG
# names a second scaling stage's files apart from the first's (e.g. one with other PYTEST_ARGS).
stage_scaling() {
  local backends=${1:-triton,bf16-model} tag=${SCALE_TAG:-} gpus cpus one all
  gpus=$(nvidia-smi --list-gpus | wc -l)
  cpus=$(core_share 0 "$gpus")
  stage_premerge "$gpus" "${backends//,/ }" scale_warm$tag > /dev/null
  stage_premerge 1 "${backends//,/ }" scale_1gpu$tag "$cpus" > /dev/null
  stage_premerge "$gpus" "${backends//,/ }" scale_all$tag > /dev/null
  one=$(awk '/^run:/ {print $2}' "$OUT/scale_1gpu$tag.timeline.txt")
  all=$(awk '/^run:/ {print $2}' "$OUT/scale_all$tag.timeline.txt")
  {
    grep -h "^run:" "$OUT/scale_1gpu$tag.timeline.txt" "$OUT/scale_all$tag.timeline.txt"
    echo "scaling$tag: 1 GPU ($(tr , '\n' <<< "$cpus" | wc -l) cores) $one s, $gpus GPUs $all s: $(python3 -c "print(f'{$one / $all:.2f}')")x"
    python3 -m verify same --a /tmp/jfa/scale_1gpu$tag.jsonl --b /tmp/jfa/scale_all$tag.jsonl
  } 2>&1 | tee "$OUT/scaling$tag.txt"
}

# repeat [BACKEND [RUNS]]: python -m verify.repeat on the scheduling-adversarial cases, RUNS (200) runs each, with
# deterministic=True (dq too must repeat bitwise) and then in the default mode (out, lse, dk, dv); every run after
# the first starts amid other work on the GPU (--perturb; REPEAT_ARGS are added, e.g. --seed 1).
stage_repeat() {
  local backend=${1:-triton} runs=${2:-200} mode
  for mode in --deterministic ""; do
    for_backends "$backend" timeout 240 python3 -m verify.repeat --backend "$backend" --runs "$runs" --perturb $mode \
      ${REPEAT_ARGS:-} 2>&1 |
      tee -a "$OUT/repeat_$backend.txt"
  done
}

# fuzz BACKEND [SECONDS]: python -m verify fuzz, Hypothesis' search of the fuzzer's families for a failing case
# and its shrinking, for SECONDS (240); FUZZ_ARGS are added (e.g. --seed 7 --family empty_runs).
stage_fuzz() {
  local backend=$1 seconds=${2:-240}
  for_backends "$backend" python3 -m verify fuzz --backend "$backend" --seconds "$seconds" --examples 100000 -v \
    ${FUZZ_ARGS:-} 2>&1 | tee "$OUT/fuzz_$backend.txt"
}

run_stage() {
  echo "=== $1 ($(date -u +%H:%M:%S))"
  case $1 in
    premerge:*) IFS=: read -r _ gpus backends tag cpus <<< "$1"; stage_premerge "$gpus" "${backends//,/ }" "$tag" "$cpus" ;;
    sanitizer:*) IFS=: read -r _ tool backend shard <<< "$1"; stage_sanitizer "$tool" "$backend" "$shard" ;;
    tune:*) stage_tune "${1#tune:}" ;;
    ab:*) stage_ab "${1#ab:}" ;;
    repeat:*) IFS=: read -r _ backend runs <<< "$1"; stage_repeat "$backend" "$runs" ;;
    fuzz:*) IFS=: read -r _ backend seconds <<< "$1"; stage_fuzz "$backend" "$seconds" ;;
    scaling:*) stage_scaling "${1#scaling:}" ;;
    *) "stage_${1//-/_}" ;;
  esac
}

# A group's stages, each on one GPU and (premerge) its share of the cores; fbtriton is unpacked once first
# (concurrent unpacking would race). GROUP_ENV_i (i from 0) holds shell assignments for the group's i-th stage
# alone, e.g. GROUP_ENV_1='WPG=1 PYTEST_ARGS="--jfa-case offset_overflow:200"': the settings read from the
# environment (PYTEST_ARGS, the timeouts, WPG, PROFILE, ...) otherwise apply to every stage of the group.
run_group() {
  local gpus i=0 stage own_env
  gpus=$(nvidia-smi --list-gpus | wc -l)
  [[ "$1" == *tlx* || "$1" == *bench* ]] && with_fbtriton true
  IFS=+ read -ra parts <<< "$1"
  for stage in "${parts[@]}"; do
    own_env=GROUP_ENV_$i
    (
      [ -n "${!own_env:-}" ] && eval "export ${!own_env}"
      CUDA_VISIBLE_DEVICES=$((i % gpus)) GROUP_CPUS=$(core_share $i ${#parts[@]}) run_stage "$stage"
    ) > "/tmp/jfa/group_$i.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  for ((i = 0; i < ${#parts[@]}; i++)); do cat "/tmp/jfa/group_$i.log"; done
}

for stage in "$@"; do
  if [[ "$stage" == *+* ]]; then run_group "$stage"; else run_stage "$stage"; fi
done

# PACK=1: everything under $OUT in one archive (the device tool brings back only a few files per call).
if [ -n "${PACK:-}" ]; then
  tar czf /tmp/session.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/session.tgz "$OUT/"
fi
