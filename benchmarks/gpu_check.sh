#!/usr/bin/env bash
# The one-GPU check: on a machine with one CUDA GPU (and no network), install what its image lacks from wheels
# carried along, run the kernel tests on the COMPILED kernels (TRITON_INTERPRET=0, CUDA tensors), then
# benchmarks/gpu_attention.py and benchmarks/gpu_train.py, and write everything to ONE JSON-lines file:
#
#   {"record": "env", ...}                      torch / triton / CUDA versions, GPU name, driver, mode
#   {"record": "stage", "stage": ..., "status": "ok" | "failed" | "timeout", "exit_code": ..., "seconds": ...}
#   {"name": ..., "shape": ..., "value": ..., "unit": ...}     each benchmark measurement, verbatim
#   {"record": "summary", "ok": ..., "stages": {...}, "seconds": ...}
#
# A stage's measurement lines come just before its stage line. Every stage runs under its own `timeout`, and the
# stage timeouts fit a total budget (GPU: 470 s, under 8 minutes); a failed or timed-out stage is reported and the
# next one runs. Each stage's full output is kept beside the file, in <file without .jsonl>.logs/<stage>.log.
# Exit status: 0 when every stage is ok, 1 otherwise.
#
# Here (with the package index), fill the wheels folder once (git-ignored; pinned to the versions installed here):
#   bash benchmarks/gpu_check.sh --fill-wheels            # -> wheels/
# On the GPU machine (the device tool: carry ["wheels"]), from the repository root:
#   bash benchmarks/gpu_check.sh                          # -> $OUT/gpu_check.jsonl (or ./gpu_check.jsonl)
# On a CPU (auto without CUDA, or --cpu): the same stages at smoke size, the kernels under Triton's interpreter
# (a subset of the kernel tests); tests/benchmarks/test_gpu_check.py runs this mode so the script does not rot:
#   bash benchmarks/gpu_check.sh --cpu --out /tmp/gpu_check.jsonl
#
# Options: --cpu | --gpu (default: gpu when torch sees CUDA), --out FILE, --wheels DIR (default: wheels/),
# --install (install from the wheels even when nothing is missing), --fill-wheels, -h.
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S (the total budget), GPU_CHECK_KERNEL_ARGS (extra pytest
# arguments), GPU_CHECK_KERNEL_WORKERS (pytest-xdist workers on the GPU, default 8; 0 = none),
# GPU_CHECK_ATTENTION_ARGS, GPU_CHECK_TRAIN_ARGS (replace the benchmarks' arguments).

set -uo pipefail

START=$(date +%s)   # the budget counts from here
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
# What the image lacks: the packages of the wheels folder, and the modules that show them installed (same order).
PACKAGES="hydra-core omegaconf antlr4-python3-runtime"
MODULES="hydra omegaconf antlr4"

MODE=auto
OUT_FILE=""
WHEELS="$REPO/wheels"
FORCE_INSTALL=0
FILL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --gpu) MODE=gpu ;;
    --out) OUT_FILE="${2:?--out needs a file}"; shift ;;
    --out=*) OUT_FILE="${1#--out=}" ;;
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift ;;
    --wheels=*) WHEELS="${1#--wheels=}" ;;
    --install) FORCE_INSTALL=1 ;;
    --fill-wheels) FILL=1 ;;
    -h|--help) sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# --- here: fill the wheels folder -------------------------------------------------------------------------------
if [ "$FILL" = 1 ]; then
  set -e
  pins=()
  for p in $PACKAGES; do
    v="$("$PY" -c 'import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))' "$p")" || {
      echo "gpu_check.sh: $p is not installed here (pip install -e '.[test]' first)" >&2; exit 1; }
    pins+=("$p==$v")
  done
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl
  # Pure-Python wheels (py3-none-any); --no-deps: their other needs (PyYAML, packaging) are in the image.
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$WHEELS" "${pins[0]}" "${pins[1]}"
  # antlr4-python3-runtime 4.9.x is published as a source archive only: build its (pure-Python) wheel here, since
  # an offline install of a source archive would need setuptools from the index.
  "$PY" -m pip wheel --quiet --no-deps -w "$WHEELS" "${pins[2]}"
  echo "gpu_check.sh: wheels for ${pins[*]} in $WHEELS:"
  ls -l "$WHEELS"
  exit 0
fi

# --- mode, output, environment ----------------------------------------------------------------------------------
if [ "$MODE" = auto ]; then
  if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    MODE=gpu
  else
    MODE=cpu
  fi
fi
if [ -z "$OUT_FILE" ]; then
  OUT_FILE="${OUT:-.}/gpu_check.jsonl"
fi
mkdir -p "$(dirname "$OUT_FILE")"
OUT_FILE="$(cd "$(dirname "$OUT_FILE")" && pwd)/$(basename "$OUT_FILE")"
LOGDIR="${OUT_FILE%.jsonl}.logs"
mkdir -p "$LOGDIR"
: > "$OUT_FILE"

# Where the wheels are installed (the image's own site-packages stay as they are); removed at exit.
SITE="$(mktemp -d "${TMPDIR:-/tmp}/dsv4-gpu-check-site.XXXXXX")" || exit 1
trap 'rm -rf "$SITE"' EXIT
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"   # dsv4 from this checkout, installed or not
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
cd "$REPO" || exit 1

if [ "$MODE" = gpu ]; then
  export TRITON_INTERPRET=0 DSV4_KERNEL_DEVICE=cuda
  BUDGET="${GPU_CHECK_BUDGET_S:-470}"
  T_ENV=20; T_INSTALL=60; T_KERNELS=130; T_ATTENTION=120; T_TRAIN=110
  workers="${GPU_CHECK_KERNEL_WORKERS:-8}"
  KERNEL_ARGS=()
  if [ "$workers" != 0 ] && "$PY" -c 'import xdist' >/dev/null 2>&1; then
    KERNEL_ARGS+=(-n "$workers")   # Triton compiles on the host's cores: several test processes share the GPU
  fi
  read -r -a ATTENTION_ARGS <<< "${GPU_CHECK_ATTENTION_ARGS:---seq-lens 8192 32768 65536 --ratios 4 128 --repeats 3}"
  read -r -a TRAIN_ARGS <<< "${GPU_CHECK_TRAIN_ARGS:---layers 2 --experts 32 --seq-len 32768 --steps 6 --warmup 2}"
else
  export TRITON_INTERPRET=1 DSV4_KERNEL_DEVICE=cpu
  BUDGET="${GPU_CHECK_BUDGET_S:-1500}"   # a safety net: the CPU mode takes well under two minutes
  T_ENV=120; T_INSTALL=120; T_KERNELS=400; T_ATTENTION=400; T_TRAIN=400
  # The interpreter runs the whole kernel suite in minutes (the test suite does that itself): a quick subset here.
  quick="test_backend_resolution or test_meta or test_documents_shorter_than_window"
  # one process (-n 0): xdist workers would each import torch and Triton for five quick tests
  KERNEL_ARGS=(-n 0 -k "$quick or test_matches_indexer_module")
  read -r -a ATTENTION_ARGS <<< "${GPU_CHECK_ATTENTION_ARGS:---smoke}"
  read -r -a TRAIN_ARGS <<< "${GPU_CHECK_TRAIN_ARGS:---smoke}"
fi
read -r -a EXTRA_KERNEL_ARGS <<< "${GPU_CHECK_KERNEL_ARGS:-}"
DEADLINE=$((START + BUDGET))
STATUSES=()

# record stage NAME RC MS LIMIT LOG EXTRA-JSON | record summary JSON: the one place that writes the output file (a
# small Python helper, so quoting is safe); a stage's record passes its log's JSON lines on and prints its status.
record() {
  "$PY" - "$OUT_FILE" "$@" <<'PYEOF'
import json, re, sys
out, kind, *args = sys.argv[1:]
lines = []
if kind == "stage":
    name, rc, ms, limit, log, extra = args
    rc, seconds = int(rc), round(int(ms) / 1e3, 2)
    # 124: `timeout` stopped it; 137 (SIGKILL) counts as a timeout only when the limit was reached (else: OOM killer)
    timed_out = rc == 124 or (rc == 137 and seconds >= int(limit))
    status = "ok" if rc == 0 else ("timeout" if timed_out else "failed")
    rec = {"record": "stage", "stage": name, "status": status, "exit_code": rc, "seconds": seconds,
           "timeout_s": int(limit), "log": log}
    rec.update(json.loads(extra or "{}"))
    text = open(log, errors="replace").read() if log else ""
    measured = 0
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "name" in obj and "value" in obj:  # a benchmark measurement
                lines.append(obj)
                measured += 1
            elif isinstance(obj, dict) and obj.get("record") == "env":
                lines.append(obj)
    rec["measurements"] = measured
    summary = [l for l in text.splitlines() if re.match(r"^=*\s*\d+ (passed|failed|error|skipped|deselected)", l)
               or re.match(r"^=+ .*(passed|failed|error|no tests ran).* =+$", l)]
    if summary:  # pytest's closing line: the counts
        rec["pytest"] = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed"
                                                          r"|xpassed|warnings?)", summary[-1])}
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
        if failed:
            rec["failed_tests"] = failed[:50]
    if status != "ok":
        rec["tail"] = text[-4000:]
    lines.append(rec)
else:  # a ready-made record
    lines.append(json.loads(args[0]))
with open(out, "a") as f:
    for obj in lines:
        f.write(json.dumps(obj) + "\n")
print(json.dumps(lines[-1])[:400], file=sys.stderr)
if kind == "stage":
    print(lines[-1]["status"])  # for the summary
PYEOF
}

# run_stage NAME TIMEOUT_S COMMAND...: run under `timeout`, cut to the time left in the budget; never stops the script.
run_stage() {
  local name="$1" limit="$2"; shift 2
  local log="$LOGDIR/$name.log" now left t0 t1 rc
  now=$(date +%s)
  left=$((DEADLINE - now - 10))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 1 ]; then
    echo "stage $name: no time left in the ${BUDGET} s budget" > "$log"
    STATUSES+=("$name=$(record stage "$name" 124 0 0 "$log" '{"skipped": "budget spent"}')")
    return
  fi
  echo "== gpu_check: $name (timeout ${limit} s): $*" >&2
  t0=$(date +%s%N)
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  STATUSES+=("$name=$(record stage "$name" "$rc" "$(((t1 - t0) / 1000000))" "$limit" "$log" "${STAGE_EXTRA:-}")")
  STAGE_EXTRA=""
}

# --- stage: env --------------------------------------------------------------------------------------------------
env_record() {
  "$PY" - "$MODE" "$REPO" <<'PYEOF'
import json, os, platform, subprocess, sys
mode, repo = sys.argv[1:]
rec = {"record": "env", "mode": mode, "python": platform.python_version(), "executable": sys.executable,
       "cpu_count": os.cpu_count(),
       "settings": {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "DSV4_KERNEL_DEVICE", "CUDA_VISIBLE_DEVICES")}}
try:
    rec["commit"] = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                                   timeout=10).stdout.strip() or None
except Exception:
    rec["commit"] = None
import torch
rec.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    rec.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
               capability=list(torch.cuda.get_device_capability(0)),
               gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
               cudnn=torch.backends.cudnn.version())
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=15)
    rec["nvidia_smi"] = smi.stdout.strip() or None
except Exception:
    rec["nvidia_smi"] = None
try:
    import triton
    import triton.language as tl
    rec.update(triton=triton.__version__, triton_has_topk=hasattr(tl, "topk") and hasattr(tl, "bitonic_merge"))
except Exception as exc:  # reported, not fatal: the torch path still runs
    rec["triton"] = f"not importable: {exc!r}"[:300]
print(json.dumps(rec))
PYEOF
}

export -f env_record
export PY MODE REPO
run_stage env "$T_ENV" bash -c env_record   # its {"record": "env"} line goes to the file before the stage line

# --- stage: install ----------------------------------------------------------------------------------------------
install_missing() {
  local missing=() m packages=($PACKAGES) i=0
  for m in $MODULES; do
    if ! "$PY" -c "import $m" >/dev/null 2>&1; then missing+=("${packages[$i]}"); fi
    i=$((i + 1))
  done
  echo "missing: ${missing[*]:-none}"
  if [ ${#missing[@]} -eq 0 ] && [ "$FORCE_INSTALL" = 0 ]; then
    return 0
  fi
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $WHEELS: fill it where the index is reachable (bash benchmarks/gpu_check.sh --fill-wheels)" \
         "and carry it along"
    return 3
  fi
  "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "$WHEELS"/*.whl || return $?
  for m in $MODULES; do "$PY" -c "import $m; print('$m', getattr($m, '__version__', ''), $m.__file__)" || return 4; done
}
INSTALLED="$("$PY" -c 'import json, importlib.metadata as m, sys
out = {}
for p in sys.argv[1:]:
    try: out[p] = m.version(p)
    except m.PackageNotFoundError: out[p] = None
print(json.dumps(out))' $PACKAGES 2>/dev/null || echo '{}')"
STAGE_EXTRA="{\"installed_before\": $INSTALLED}"
export -f install_missing
export WHEELS SITE FORCE_INSTALL PACKAGES MODULES
run_stage install "$T_INSTALL" bash -c install_missing

# --- stage: the kernel tests -------------------------------------------------------------------------------------
run_stage kernel_tests "$T_KERNELS" "$PY" -m pytest -q -rfE -p no:cacheprovider tests/unit/kernels \
    "${KERNEL_ARGS[@]}" "${EXTRA_KERNEL_ARGS[@]}"

# --- stages: the GPU benchmarks (one JSON object per line) -------------------------------------------------------
run_stage gpu_attention "$T_ATTENTION" "$PY" benchmarks/gpu_attention.py "${ATTENTION_ARGS[@]}"
run_stage gpu_train "$T_TRAIN" "$PY" benchmarks/gpu_train.py "${TRAIN_ARGS[@]}"

# --- summary -----------------------------------------------------------------------------------------------------
OK=true
STAGES_JSON=""
for s in "${STATUSES[@]}"; do
  [ "${s#*=}" = ok ] || OK=false
  STAGES_JSON="$STAGES_JSON${STAGES_JSON:+, }\"${s%%=*}\": \"${s#*=}\""
done
record summary "{\"record\": \"summary\", \"mode\": \"$MODE\", \"ok\": $OK, \"stages\": {$STAGES_JSON}, \
\"seconds\": $(($(date +%s) - START)), \"budget_s\": $BUDGET, \"output\": \"$OUT_FILE\"}"
echo "gpu_check: $MODE mode, ${STATUSES[*]}; $(wc -l < "$OUT_FILE") lines in $OUT_FILE" >&2
[ "$OK" = true ]
