#!/usr/bin/env bash
# Sum-kernel study on one GPU in one bounded run: build (sm_90 only), the kernel tests,
# scripts/sum_kernel_bench.py over every variant at 16 and 32 CTAs with 1 and 3 staged sources
# (copy-kernel rows of the same run), Nsight Compute, and the built module's SASS.
#
#   bash scripts/sum_kernel_study.sh OUTDIR [study|final|check]
#
# study (default): ncu on the baselines (regs, tma, copy) and on the bench's two fastest
# candidates per staged count. final: five bench rounds, written as <date>-sum-kernels.json
# (benchmarks/results' file, also copied to OUTDIR), and ncu on the bench's fastest variant per
# staged count next to the copy kernel; budget 270 s by default. check: the kernel and rejection
# tests and a short bench of auto (measured as auto) next to tma_lean at its tile, tma, regs and
# the copy kernel (<date>-sum-kernels-auto.json, also copied to OUTDIR); no SASS dump, no ncu;
# budget 150 s by default. In every mode a crash of the rejection tests is followed by
# diagnostics (crash-matrix.txt, foreign-bindings.txt, rejects-gdb.log), ~70 s at most.
#
# Every step has a time limit and all of them share one budget (TIDE_STUDY_BUDGET_S, default 390 s
# for study, build included), so the run ends well inside 7 minutes whatever hangs. OUTDIR
# receives summary.txt (step results, the bench table, test outcome, ncu headlines) and
# sum-kernel-study.tar.gz (every log, JSON, ncu export and the SASS). The working files live in a
# temporary folder until they are packed. TIDE_COMMIT, if set, is recorded as the bench's commit
# (a copy of the checkout may have no git repository of its own).
set -uo pipefail
cd "$(dirname "$0")/.."
study_out=${1:?usage: scripts/sum_kernel_study.sh OUTDIR [study|final|check]}
mode=${2:-study}
case $mode in
  study) default_budget=390 rounds=3 bench_json=sum-kernels.json ;;
  final) default_budget=270 rounds=5 bench_json=$(date -u +%F)-sum-kernels.json ;;
  check) default_budget=150 rounds=5 bench_json=$(date -u +%F)-sum-kernels-auto.json ;;
  *) echo "mode must be study, final or check, not $mode" >&2 && exit 2 ;;
esac
mkdir -p "$study_out"
study_out=$(cd "$study_out" && pwd)
budget=${TIDE_STUDY_BUDGET_S:-$default_budget}
pack_reserve=15  # seconds kept for packing
work=$(mktemp -d /tmp/sum-kernel-study.XXXXXX)/sum-kernel-study
mkdir -p "$work"
PY=${PYTHON:-python3}
# NVLink multicast must stay off (it can take shared GPUs out of service): set, never unset.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
start=$SECONDS

log() { echo "[$((SECONDS - start)) s] $*" | tee -a "$work/steps.txt"; }

# step NAME LIMIT COMMAND...: runs COMMAND with its output in NAME.log, killed after
# min(LIMIT, what is left of the budget) seconds; returns its exit status (124: timed out, 99: skipped).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - pack_reserve - (SECONDS - start)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    log "$name: skipped, budget spent"
    return 99
  fi
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$work/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s): $*"
  return $rc
}

pack() {
  trap - EXIT
  {
    echo "== steps"
    cat "$work/steps.txt"
    echo "== kernel tests"
    tail -n 15 "$work/tests.log" 2>/dev/null
    echo "== rejected arguments"
    grep -E "PASSED|FAILED|ERROR|Fatal|passed|failed" "$work/tests-rejects.log" 2>/dev/null | tail -n 14
    if [ -f "$work/crash-matrix.txt" ]; then
      echo "== crash diagnostics: which process state makes a tide_core._C throw crash"
      cat "$work/crash-matrix.txt"
      echo "-- tide_core._C's symbols bound outside the C++ runtime, libc and Python (LD_DEBUG)"
      head -n 40 "$work/foreign-bindings.txt" 2>/dev/null
      echo "-- native backtrace (cuda-gdb)"
      sed -n '/received signal/,/^From /p' "$work/rejects-gdb.log" 2>/dev/null | head -n 45
    fi
    echo "== toolchain"
    cat "$work/toolchain.txt" 2>/dev/null
    echo "== pybind11"
    cat "$work/pybind11.log" 2>/dev/null
    echo "== FFMA in the sum kernels' SASS (the alpha path must have none)"
    cat "$work/ffma.txt" 2>/dev/null
    echo "== bench"
    sed -n '/^staged ctas kernel/,$p' "$work/bench.log" 2>/dev/null
    echo "== ncu headlines"
    cat "$work/ncu-headlines.txt" 2>/dev/null
  } > "$work/summary.txt"
  cp "$work/summary.txt" "$study_out/summary.txt"
  [ "$mode" != study ] && [ -f "$work/$bench_json" ] && cp "$work/$bench_json" "$study_out/"
  local base
  base=$(dirname "$work")
  tar czf "$study_out/sum-kernel-study.tar.gz" -C "$base" sum-kernel-study
  if [ "$(stat -c %s "$study_out/sum-kernel-study.tar.gz")" -gt $((15 << 20)) ]; then  # keep the archive under 16 MiB
    tar czf "$study_out/sum-kernel-study.tar.gz" -C "$base" --exclude "*.ncu-rep" sum-kernel-study
  fi
  echo "packed: $study_out/summary.txt, $study_out/sum-kernel-study.tar.gz ($(stat -c %s "$study_out/sum-kernel-study.tar.gz") bytes)"
  rm -rf "$base"
}
trap pack EXIT

{
  nvidia-smi
  nvidia-smi -q -d CLOCK,PERFORMANCE
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nvcc --version
  ncu --version
  git log -1 --format='commit %H %s' 2>/dev/null
  git status --short 2>/dev/null
} > "$work/machine.txt" 2>&1

if ! step build 200 env TIDE_CUDA_ARCHS=90 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  $PY -m pip install --no-deps --no-build-isolation -e .; then
  tail -n 40 "$work/build.log"
  exit 1
fi
step import 60 $PY -c "import tide_core._C as c; print(c.__file__); print(c.SUM_KERNELS)" || exit 1
module=$(sed -n 1p "$work/import.log")
# Which pybind11 built the module and whose translator state it shares (the internals key each
# extension was built with; equal keys share exception translators).
step pybind11 20 $PY - "$module" <<'EOF'
import re, sys
from pathlib import Path

import pybind11
import torch

print("pybind11", pybind11.__version__)
torch_lib = Path(torch.__file__).parent / "lib" / "libtorch_python.so"
for path in (sys.argv[1], torch_lib):
    keys = sorted(set(re.findall(rb"__pybind11_internals_v\w+", Path(path).read_bytes())))
    print(Path(path).name, [k.decode() for k in keys])
EOF

# What built the module and how it links (the compilers, the linker, dynamic flags and dependencies).
{
  for tool in c++ gcc ld; do echo "$tool: $($tool --version 2>&1 | head -n 1)"; done
  echo "nvcc: $(nvcc --version 2>&1 | grep -m1 release)"
  grep -hE "^CMAKE_(CXX_COMPILER|CUDA_COMPILER|CUDA_HOST_COMPILER|BUILD_TYPE|CUDA_ARCHITECTURES):" build/*/CMakeCache.txt
  readelf -d "$module" | grep -E "NEEDED|FLAGS|BIND"
  echo "dynamic symbols defined: $(nm -D --defined-only "$module" | wc -l)"
} > "$work/toolchain.txt" 2>&1

# SASS of the bf16 sum kernels and the copy kernel (encodings dropped), and every kernel's resources.
[ "$mode" != check ] && step sass 30 bash -c "cuobjdump -sass '$module' | awk '/Function :/ {keep = (\$0 ~ /bfloat16|copy_kernel/)} keep' \
  | grep -v '^ *\/\* 0x' | gzip > '$work/sass-bf16-and-copy.txt.gz' && cuobjdump -res-usage '$module' > '$work/res-usage.txt'"
# Sum kernels (bf16 and fp16) whose SASS has a fused multiply-add: none may (two roundings).
step ffma 30 bash -c "cuobjdump -sass '$module' | awk '/Function :/ {f = \$0} /FFMA/ && f ~ /sum_/ {if (!(f in n)) c++; n[f]++}
  END {for (k in n) print n[k], k; print c + 0, \"sum functions with FFMA\"}' > '$work/ffma.txt'"

# After a crash of the rejection tests: which process state makes a throw from tide_core._C crash,
# each case in a process of its own (crash-matrix.txt: exit -11 is SIGSEGV); tide_core._C's
# symbols that the dynamic linker bound outside the C++ runtime, libc and Python in the tests'
# order (torch, CUDA initialised, then tide_core._C imported: foreign-bindings.txt); and a native
# backtrace of the first crashing case (cuda-gdb debugs host code; gdb where it exists).
diagnose_crash() {
  step crash-matrix 30 $PY - "$work" <<'PYTHON'
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

nvcc_throw = "c.launch_sum(0, [0], [(0, 8, 8, 0)], 0, 8, 1.0, False, 0, 1, 0, 99)"  # sum_kernel.cu
cxx_throw = "c.memcpy_batch([0], [], [1], 0)"  # copy_engine.cpp: the C++ compiler's code
cuda = "torch.cuda.init()"
cases = {
    "no torch, nvcc throw": ["import tide_core._C as c", nvcc_throw],
    "torch, no CUDA init, nvcc throw": ["import torch", "import tide_core._C as c", nvcc_throw],
    "_C imported before CUDA init, nvcc throw": ["import torch", "import tide_core._C as c", cuda, nvcc_throw],
    "CUDA init before _C import, nvcc throw": ["import torch", cuda, "import tide_core._C as c", nvcc_throw],
    "CUDA init before _C import, c++ throw": ["import torch", cuda, "import tide_core._C as c", cxx_throw],
    "CUDA init, torch's own C++ error": ["import torch", cuda, "torch.zeros(2).view(3)"],
}


def run(lines):
    *setup, call = lines
    code = "\n".join(setup + ["try:", f"    {call}", "except RuntimeError as e:", "    print('raised:', e)"])
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    out = (r.stdout + r.stderr).strip().splitlines()
    return r.returncode, out[-1][:150] if out else ""


with ThreadPoolExecutor(len(cases)) as pool:
    results = dict(zip(cases, pool.map(run, cases.values())))
work = Path(sys.argv[1])
with open(work / "crash-matrix.txt", "w") as f:
    for name, (rc, last) in results.items():
        print(f"{name:42s} exit {rc}: {last}", file=f)
crashed = [name for name, (rc, _) in results.items() if rc != "timeout" and rc < 0]  # killed by a signal
case = cases[crashed[0] if crashed else "CUDA init before _C import, nvcc throw"]
(work / "crash-case.py").write_text("\n".join(case) + "\n")
PYTHON
  local ld_dir
  ld_dir=$(mktemp -d /tmp/sum-kernel-ld.XXXXXX)
  step ld-bindings 30 env LD_DEBUG=bindings LD_DEBUG_OUTPUT="$ld_dir/ld" $PY -c \
    "import torch; torch.cuda.init(); import tide_core._C as c; c.launch_sum(0, [0], [(0, 8, 8, 0)], 0, 8, 1.0, False, 0, 1, 0, 99)"
  cat "$ld_dir"/ld.* 2> /dev/null | grep "binding file [^ ]*tide_core/_C" |
    grep -vE "to [^ ]*(libstdc\+\+|libc\.so|libgcc_s|libm\.so|libdl|libpthread|librt|ld-linux|libpython|tide_core/_C)" |
    sed -E 's/^[[:space:]]*[0-9]+:[[:space:]]*//' | sort | uniq -c | sort -rn > "$work/foreign-bindings.txt"
  echo "$(wc -l < "$work/foreign-bindings.txt") distinct bindings outside libstdc++, libc, libgcc_s, libm, Python" \
    >> "$work/foreign-bindings.txt"
  rm -rf "$ld_dir"
  local debugger
  debugger=$(command -v cuda-gdb || command -v gdb)
  if [ -n "$debugger" ] && [ -f "$work/crash-case.py" ]; then
    step rejects-gdb 40 "$debugger" -batch -ex "set pagination off" -ex run -ex bt -ex "info sharedlibrary" \
      --args $PY "$work/crash-case.py"
  else
    log "rejects-gdb: skipped (no cuda-gdb or gdb, or no crash case)"
  fi
}

# The kernel tests, the argument-rejection tests after the bench and on their own: a crash there
# (as under torch 2.11 on H200) must not cost the bitwise tests or the bench.
step tests 150 $PY -m pytest -v -rfE -m cuda -p no:cacheprovider tests/csrc/test_kernels_gpu.py -k "not rejects"
# The bench before the rejection tests, so that a crash's diagnostics cannot take its time.
bench_variants=()
[ "$mode" = check ] && bench_variants=(--variants "auto,tma_lean@tile=8192,tma,regs")
step bench 120 $PY scripts/sum_kernel_bench.py "$work/$bench_json" --ctas 16,32 --staged 1,3 --rounds "$rounds" \
  "${bench_variants[@]}"
if ! step tests-rejects 40 $PY -m pytest -v -rfE -p no:cacheprovider tests/csrc/test_build.py \
  tests/runtime/test_device.py tests/csrc/test_kernels_gpu.py -k "rejects or rejected or raise"; then
  grep -qE "Fatal Python error|Segmentation fault" "$work/tests-rejects.log" && diagnose_crash
fi


# Nsight Compute: try it small first (it may not work with this machine's driver); the extra metrics
# (throughput breakdowns, L1<->L2 bytes) go if they are what fails.
# Only TIDE's kernels (the sums and the copy kernel): their demangled names start in namespace tide.
ncu_base=(ncu --clock-control none --kernel-name-base demangled -k "regex:tide::")
metrics="breakdown:l1tex__throughput.avg.pct_of_peak_sustained_active,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed"
metrics+=",l1tex__m_xbar2l1tex_read_bytes.sum.per_second,l1tex__m_l1tex2xbar_write_bytes.sum.per_second"
metrics+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum"
# A probe counts only if it profiled the one copy-kernel launch.
profiled() { [ "$(grep -c '==PROF== Profiling' "$work/$1.log")" -ge 1 ]; }
ncu_ok=1
if [ "$mode" = check ]; then
  ncu_ok=0
elif ! step ncu-probe 20 "${ncu_base[@]}" --section SpeedOfLight --metrics "$metrics" \
  $PY scripts/ncu_sum_kernel.py --variants "" --staged 1 || ! profiled ncu-probe; then
  metrics=""
  if ! step ncu-probe-plain 20 "${ncu_base[@]}" --section SpeedOfLight \
    $PY scripts/ncu_sum_kernel.py --variants "" --staged 1 || ! profiled ncu-probe-plain; then
    ncu_ok=0
    log "ncu: skipped (the probes failed, see ncu-probe*.log)"
  fi
fi
if [ $ncu_ok = 1 ]; then
  sections=()
  for s in SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Chart MemoryWorkloadAnalysis_Tables \
    ComputeWorkloadAnalysis SchedulerStats WarpStateStats InstructionStats LaunchStats Occupancy SourceCounters; do
    sections+=(--section "$s")
  done
  [ -n "$metrics" ] && sections+=(--metrics "$metrics")
  if [ "$mode" = study ]; then
    step ncu-baseline 110 "${ncu_base[@]}" "${sections[@]}" -f -o "$work/ncu-baseline" \
      $PY scripts/ncu_sum_kernel.py --staged 1,3 --ctas 16 --variants regs,tma --order "$work/ncu-baseline-order.json"
    if [ -f "$work/$bench_json" ]; then
      step ncu-candidates 110 "${ncu_base[@]}" "${sections[@]}" -f -o "$work/ncu-candidates" \
        $PY scripts/ncu_sum_kernel.py --staged 1,3 --ctas 16 --variants "" --best-from "$work/$bench_json" \
        --best 2 --exclude regs,tma,auto --no-copy --order "$work/ncu-candidates-order.json"
    fi
  elif [ -f "$work/$bench_json" ]; then
    # The after figures: the fastest variant per staged count (auto's choice) and the copy kernel.
    step ncu-final 110 "${ncu_base[@]}" "${sections[@]}" -f -o "$work/ncu-final" \
      $PY scripts/ncu_sum_kernel.py --staged 1,3 --ctas 16 --variants "" --best-from "$work/$bench_json" \
      --best 1 --exclude auto --order "$work/ncu-final-order.json"
  fi
  for rep in "$work"/ncu-*.ncu-rep; do
    [ -f "$rep" ] || continue
    name=$(basename "$rep" .ncu-rep)
    step "$name-details" 30 ncu -i "$rep" --page details --print-details all --print-units base ||
      step "$name-details" 30 ncu -i "$rep" --page details --print-units base
    step "$name-raw" 30 ncu -i "$rep" --page raw --csv --print-units base && mv "$work/$name-raw.log" "$work/$name-raw.csv"
    # Per-instruction counters and stall samples (SASS view), one export per profiled launch.
    launches=$($PY -c "import json, sys; print(len(json.load(open(sys.argv[1]))))" "$work/$name-order.json" 2>/dev/null)
    for ((i = 0; i < ${launches:-0}; i++)); do
      if step "$name-source-$i" 20 ncu -i "$rep" --page source --csv --print-source sass --launch-skip "$i" \
        --launch-count 1; then
        mv "$work/$name-source-$i.log" "$work/$name-source-$i.csv" && gzip "$work/$name-source-$i.csv"
      else
        step "$name-source" 40 ncu -i "$rep" --page source --csv --print-source sass &&
          mv "$work/$name-source.log" "$work/$name-source.csv" && gzip "$work/$name-source.csv"
        break
      fi
    done
  done
  # Headline figures per profiled launch (order files name them).
  $PY - "$work" > "$work/ncu-headlines.txt" 2>&1 <<'EOF'
import csv, json, re, sys
from pathlib import Path


def num(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


work = Path(sys.argv[1])
wanted = [
    r"gpu__time_duration\.sum$",
    r"dram__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"lts__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"l1tex__throughput\.avg\.pct_of_peak_sustained_active$",
    r"l1tex__m_(xbar2l1tex_read|l1tex2xbar_write)_bytes\.sum\.per_second$",
    r"smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
    r"smsp__inst_executed\.sum$",
    r"launch__registers_per_thread$",
]
for name in ("ncu-baseline", "ncu-candidates", "ncu-final"):
    raw, order = work / f"{name}-raw.csv", work / f"{name}-order.json"
    if not raw.exists():
        continue
    rows = list(csv.reader(raw.open()))
    header, data = rows[0], rows[2:]
    labels = json.loads(order.read_text()) if order.exists() else [{}] * len(data)
    print(f"== {name}: {len(data)} launches")
    stall = [i for i, h in enumerate(header) if re.match(r"smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio$", h)]
    for row, label in zip(data, labels):
        print(label, row[header.index("Kernel Name")] if "Kernel Name" in header else "")
        for pattern in wanted:
            for i, h in enumerate(header):
                if re.match(pattern, h):
                    print(f"    {h} = {row[i]}")
        top = sorted(((num(row[i]), header[i]) for i in stall), reverse=True)[:5]
        for value, h in top:
            print(f"    stall {h.split('stalled_')[1].split('_per')[0]} = {value:.2f} cycles per issue")
EOF
fi
log "done"
