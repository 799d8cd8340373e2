#!/usr/bin/env bash
# One device call's worth of checks: GPU tests (one process per test file, in parallel: the
# host compiles on 16 cores while the GPU runs), then benchmarks, all logs under $OUT.
# Usage on the GPU host (after unpacking the TileLang bundle and setting PYTHONPATH):
#   DEADLINE=540 bash bench/gpu_session.sh [tests|none] [bench "op shape [providers]" ...] [model]
# Every step is cut off so that the whole call ends DEADLINE seconds after it began.
set -uo pipefail
# Logs and results go to $OUT/session/ and are packed into $OUT/session.tgz at the end (the
# device tool brings back at most 8 files).
final=${OUT:-/tmp/tilecraft-out}
out=$final/session
mkdir -p "$out"
trap 'tar czf "$final/session.tgz" -C "$final" session && rm -rf "$out"' EXIT
export TILECRAFT_CACHE_DIR=${TILECRAFT_CACHE_DIR:-/tmp/tc-cache}
start=$(date +%s)
deadline=$((start + ${DEADLINE:-540}))
left() { echo $((deadline - $(date +%s))); }
# Test groups, one process each: "file" or "file:pytest -k expression" ('+' for a space); "file@N"
# (with or without ":expression") splits the file's selected GPU tests round-robin over N processes,
# so that the host compiles their kernels N at a time (one process compiles one kernel at a time).
TESTS=${TESTS:-"tests/test_rms_norm.py tests/test_gemm_fp8.py@6 tests/test_moe_route.py tests/test_moe_dispatch.py
  tests/test_topk_select.py@3 tests/test_tile_words.py tests/test_runtime.py@3
  tests/test_mla_decode.py@2:not+(hypothesis+or+fp8) tests/test_mla_decode.py:hypothesis+or+fp8"}

if [[ "${1:-tests}" == tests ]]; then
  budget=${TEST_BUDGET:-$(( $(left) * 2 / 3 ))}
  i=0
  for t in $TESTS; do
    spec=${t%%:*}; k=${t#"$spec"}; k=${k#:}; k=${k//+/ }
    f=${spec%@*}; shards=1; [[ "$spec" == *@* ]] && shards=${spec##*@}
    if (( shards > 1 )); then
      mapfile -t ids < <(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "$f" ${k:+-k "$k"} 2>/dev/null \
                         | grep "::")
      for ((s = 0; s < shards; s++)); do
        group=()
        for ((j = s; j < ${#ids[@]}; j += shards)); do group+=("${ids[j]}"); done
        (( ${#group[@]} )) || continue
        i=$((i + 1)); n=$(basename "$f" .py)-$i
        timeout "$budget" python3 -m pytest -v -m gpu -p no:cacheprovider "${group[@]}" > "$out/$n.log" 2>&1 &
      done
    else
      i=$((i + 1)); n=$(basename "$f" .py)-$i
      timeout "$budget" python3 -m pytest -v -m gpu -p no:cacheprovider "$f" ${k:+-k "$k"} > "$out/$n.log" 2>&1 &
    fi
  done
  wait
  for f in "$out"/test_*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
  grep -h -E "^(FAILED|ERROR)" "$out"/test_*.log | cut -c1-200
fi
shift || true

model=0
nb=0
for job in "$@"; do
  [[ "$job" == model ]] && { model=1; continue; }
  set -- $job
  t=$(left); (( t > 20 )) || { echo "skipped bench $job: out of time"; continue; }
  # a third word names the providers (comma-separated; experimental kernel variants run only when named);
  # further words are bench.op's flags (--graph, --flush read)
  nb=$((nb + 1)); log="$out/bench-$nb-$1-$2.log"
  timeout "$t" python3 -m bench.op "$1" --shape "$2" --out "$out" ${3:+--providers "$3"} "${@:4}" > "$log" 2>&1
  echo "== bench $job (rc $?)"; grep -v -E "^(Warning|  warn)" "$log" | tail -14
done
if (( model )); then
  t=$(left)
  python3 -m model.make_tiny /tmp/tiny-v3 > /dev/null && \
    timeout "$t" python3 -m bench.model /tmp/tiny-v3 --batch 8 --input-len 128 --output-len 32 > "$out/bench-model.log" 2>&1
  echo "== bench model (rc $?)"; tail -15 "$out/bench-model.log"
fi
for script in ${SCRIPTS:-}; do   # extra python modules to run, e.g. SCRIPTS="bench.sweep_gemm"
  t=$(left); (( t > 20 )) || { echo "skipped $script: out of time"; continue; }
  timeout "$t" python3 -m "$script" --out "$out" > "$out/$script.log" 2>&1
  echo "== $script (rc $?)"; tail -20 "$out/$script.log"
done
