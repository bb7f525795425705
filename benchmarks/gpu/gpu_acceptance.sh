#!/usr/bin/env bash
# Issues #55's and #56's checks on a machine with a CUDA GPU, in one prepared script (the lent H200: /work/.library/device/).
#
#   bash benchmarks/gpu/gpu_acceptance.sh PULP_WHEEL [PART ...]
#
# PULP_WHEEL: a PuLP wheel carried to the machine (its image has torch, transformers, rich, hypothesis and
# pytest-xdist, not PuLP). Here, before the call:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl pulp==3.3.2     # py3-none-any, CBC bundled
# and run it with carry [".whl"]:
#     bash benchmarks/gpu/gpu_acceptance.sh .whl/pulp-3.3.2-py3-none-any.whl calibrate accuracy-gpt accuracy-llama1b budget
#     bash benchmarks/gpu/gpu_acceptance.sh .whl/pulp-3.3.2-py3-none-any.whl ranking cuda-tests suite
# (two calls of under 10 minutes each; one call with no PART runs them all, if its limit allows).
#
# PARTS, in this order by default:
#   env               torch, the GPU, the driver, PuLP and its CBC (always run first)
#   calibrate         remat calibrate: this GPU measured into a device spec file, h200-calibrated.json (issue #56;
#                     under a minute), for --device FILE; then its host figures beside the built-in ones (#60)
#   accuracy-gpt      remat accuracy on the built-in GPT at the size the shared tradeoff ran (12 layers, width 1024,
#                     batch 8 x 1024 tokens): predicted for this GPU (matched in the table) beside the real steps
#   accuracy-llama1b  remat accuracy on the Llama 3.2 1B-shaped Hugging Face model (benchmarks/gpu/gpu_targets.py:
#                     llama1b, bf16, 4 x 2048, the loop keeps only the loss), with a 24 GiB plan among the rows
#   budget            optimize_checkpointing at 24 GiB on that model, then 4 real steps: max_memory_allocated against
#                     the budget (benchmarks/gpu/gpu_budget.py; exit 1 when over)
#   ranking           benchmarks/plans/ranking.py --device cuda (issue #56): remat's plan at budgets just above every
#                     block's peak, measured beside every block in paired rounds (ranking_gpu.md)
#   cuda-tests        pytest tests/integration/test_cuda.py tests/integration/test_accuracy_command.py
#                     tests/integration/test_calibrate.py
#   suite             the whole suite, pytest -n 14
#   torchtitan        (issue #61; not in the default list, not run yet) torchtitan's parallelize_llama with remat's
#                     RematAC on its debug model, FlexAttention, 1 GPU, at 2 GiB (benchmarks/gpu/torchtitan_gpu.py): needs
#                     torchtitan 0.3's wheels carried in TORCHTITAN_WHEELS (pip download torchtitan==0.3.0 tyro
#                     spmd_types torch_checkpointing torchdata datasets ... -d .whl/titan, carry [".whl"])
#
# Everything goes under $OUT (default ./gpu-acceptance; at most 8 files come back from a device call):
#   acceptance.log    all output;  summary.txt   one line per part: exit status and seconds
#   h200-calibrated.json, accuracy_gpt.json, accuracy_llama1b.json, budget_llama1b_24gib.json, ranking_gpu.md,
#   cuda_tests.log, suite.log
# Each part runs under `timeout` (PART_TIMEOUT_S, default per part below) and the script goes on after a failure;
# its own exit status is the number of parts that failed. PYTHON (default python3) is the interpreter.

set -u -o pipefail
usage() { sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac
WHEEL=$1; shift
[ -f "$WHEEL" ] || { echo "gpu_acceptance.sh: no PuLP wheel at $WHEEL (see the header for how to carry one)" >&2; exit 2; }
ALL=(calibrate accuracy-gpt accuracy-llama1b budget ranking cuda-tests suite)
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=("${ALL[@]}")
for p in "${PARTS[@]}"; do
  case " env torchtitan ${ALL[*]} " in *" $p "*) ;; *) echo "gpu_acceptance.sh: unknown part $p (parts: env ${ALL[*]})" >&2; exit 2 ;; esac
done

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-acceptance}
mkdir -p "$OUT"
SITE=${REMAT_SITE:-/tmp/remat-site}
LOG=$OUT/acceptance.log
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
exec > >(tee -a "$LOG") 2>&1

"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEEL" \
  || { echo "gpu_acceptance.sh: installing $WHEEL failed"; exit 3; }
chmod +x "$SITE"/pulp/solverdir/cbc/linux/*/cbc 2>/dev/null  # (a wheel unpacked by pip keeps no execute bits)
export PYTHONPATH="$ROOT/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

FAILED=0
part() {  # part NAME TIMEOUT_S COMMAND...: run, log, record its status and seconds
  local name=$1 limit=${PART_TIMEOUT_S:-$2}; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))$([ $rc -eq 124 ] && echo ' (timed out)')" | tee -a "$SUMMARY"
  [ $rc -eq 0 ] || FAILED=$((FAILED + 1))
}

part env 120 "$PY" - <<'EOF'
import platform, shutil, subprocess, torch, pulp
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "capability", f"{p.major}.{p.minor}", "total_memory", p.total_memory)
    if shutil.which("nvidia-smi"):
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                             capture_output=True, text=True).stdout.strip())
else:
    print("no CUDA device: the parts that measure will refuse (exit 2)")
print("pulp", pulp.__version__, "solvers", pulp.listSolvers(onlyAvailable=True))
assert "PULP_CBC_CMD" in pulp.listSolvers(onlyAvailable=True), "PuLP's bundled CBC is not runnable"
import remat
from remat.sweeps.accuracy import check_prediction
print("remat", remat.__version__, "from", remat.__file__)
EOF

for p in "${PARTS[@]}"; do
  case $p in
    env) ;;
    calibrate)
      part calibrate 180 "$PY" -m remat calibrate --out "$OUT/h200-calibrated.json"
      # issue #60: the host's figures measured here beside the built-in ones (derived from the shared traces)
      part host-figures 60 "$PY" -c "
import sys
from remat import Target
from remat.costs.device_time import GPU_HOST
spec = Target(device=sys.argv[1]).spec
for f in ('forward_op_s', 'backward_op_s'):
    print(f'host {f}: measured here {getattr(spec, \"host_\" + f) * 1e6:.2f} us (calibrate), built in '
          f'{getattr(GPU_HOST, f) * 1e6:.2f} us (derived from the H200 traces, not measured here)')
" "$OUT/h200-calibrated.json" ;;
    accuracy-gpt)
      part accuracy-gpt 240 "$PY" -m remat accuracy gpt --layers 12 --d-model 1024 --seq-len 1024 --batch-size 8 \
        --json "$OUT/accuracy_gpt.json" ;;
    accuracy-llama1b)
      part accuracy-llama1b 420 "$PY" -m remat accuracy benchmarks/gpu/gpu_targets.py:llama1b --output-dropped \
        --budget 24 --json "$OUT/accuracy_llama1b.json" ;;
    budget)
      part budget 240 "$PY" benchmarks/gpu/gpu_budget.py benchmarks/gpu/gpu_targets.py:llama1b --budget 24 --output-dropped \
        --json "$OUT/budget_llama1b_24gib.json" ;;
    ranking)
      part ranking 300 "$PY" benchmarks/plans/ranking.py --device cuda --out "$OUT/ranking_gpu.md" ;;
    cuda-tests)
      part cuda-tests 300 bash -c "set -o pipefail; '$PY' -m pytest -q -p no:cacheprovider -rfEs \
        tests/integration/test_cuda.py tests/integration/test_accuracy_command.py tests/integration/test_calibrate.py \
        2>&1 | tee '$OUT/cuda_tests.log'" ;;
    torchtitan)
      part torchtitan 300 bash -c "'$PY' -m pip install -q --no-index --find-links '${TORCHTITAN_WHEELS:-.whl/titan}' \
        --target '$SITE' torchtitan==0.3.0 && '$PY' benchmarks/gpu/torchtitan_gpu.py --budget 2.0 \
        --json '$OUT/torchtitan_gpu.json'" ;;
    suite)
      part suite 420 bash -c "set -o pipefail; '$PY' -m pytest -q -p no:cacheprovider -rfE -n 14 2>&1 \
        | tee '$OUT/suite.log'" ;;
  esac
done

echo "=== summary ($FAILED failed)"
cat "$SUMMARY"
sleep 1  # (tee's last lines into acceptance.log before $OUT is read back)
exit "$FAILED"
