#!/usr/bin/env bash
# The full check (the README's test command), stopping at the first failure:
#   1. dependencies (scripts/install-deps.sh, which ends with the tests' npm packages: scripts/install-npm.sh)
#   2. Release build with warnings as errors in build/, then ctest
#   3. AddressSanitizer + UndefinedBehaviorSanitizer build (CPU only) in build-asan/, then ctest
#   4. libFuzzer build with clang in build-fuzz/: replay the seed corpora, then fuzz the safetensors header parser and
#      the request parser + chat renderer
# Environment: BG_FUZZ_SECONDS (default 60), BG_REQUEST_FUZZ_SECONDS (default 30), BG_SKIP_DEPS=1 (skip the apt
# part of step 1), BG_GOLDEN_DIR (default: the CMake cache
# default, ../shared/golden beside the repository).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc)"
fuzz_seconds="${BG_FUZZ_SECONDS:-60}"
request_fuzz_seconds="${BG_REQUEST_FUZZ_SECONDS:-30}"
golden_args=()
if [[ -n "${BG_GOLDEN_DIR:-}" ]]; then golden_args=(-DBG_GOLDEN_DIR="$BG_GOLDEN_DIR"); fi
# The tests compare against the golden cases: without them a hundred tests would fail after the whole build.
golden_dir="${BG_GOLDEN_DIR:-$root/../shared/golden}"
if [[ ! -d "$golden_dir" ]]; then
  echo "test.sh: no golden cases at $golden_dir: put shared/golden beside the repository or set BG_GOLDEN_DIR" >&2
  exit 2
fi

step() { printf '\n==> [%4ds] %s\n' "$SECONDS" "$*"; }

# ctest with its output kept, so the run can end with one summary line over every ctest run.
ctest_logs=()
run_ctest() {
  local log
  log="$(mktemp)"
  ctest_logs+=("$log")
  "$@" 2>&1 | tee "$log"
}

step "dependencies"
if [[ "${BG_SKIP_DEPS:-0}" != 1 ]]; then
  scripts/install-deps.sh
else
  scripts/install-npm.sh  # the tests' npm packages (a no-op when installed); ctest never fetches them
fi

step "Release build (build/, -DBG_WERROR=ON, $jobs jobs)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBG_WERROR=ON "${golden_args[@]}"
cmake --build build --parallel "$jobs"
step "Release tests"
run_ctest ctest --test-dir build --output-on-failure --parallel "$jobs"

step "ASan + UBSan build (build-asan/)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBG_SANITIZE=ON -DBG_CUDA=OFF "${golden_args[@]}"
cmake --build build-asan --parallel "$jobs"
step "ASan + UBSan tests"
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:protect_shadow_gap=0}" \
UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
  run_ctest ctest --test-dir build-asan --output-on-failure --parallel "$jobs"

step "fuzzer build (build-fuzz/, clang)"
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DBG_FUZZ=ON -DBG_TESTS=OFF -DBG_CUDA=OFF
cmake --build build-fuzz --parallel "$jobs" --target safetensors_header_fuzz request_fuzz
fuzzer=build-fuzz/safetensors_header_fuzz
mkdir -p build-fuzz/corpus build-fuzz/artifacts
step "fuzzer: replay fuzz/corpus"
"$fuzzer" -runs=0 fuzz/corpus
step "fuzzer: ${fuzz_seconds}s on the safetensors header parser"
# New inputs go to build-fuzz/corpus (the first directory); crashes to build-fuzz/artifacts/.
"$fuzzer" -max_total_time="$fuzz_seconds" -max_len=4096 -dict=fuzz/safetensors.dict \
  -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 build-fuzz/corpus fuzz/corpus
step "fuzzer: replay fuzz/request_corpus, then ${request_fuzz_seconds}s on the request parser + chat renderer"
mkdir -p build-fuzz/request_corpus
build-fuzz/request_fuzz -runs=0 fuzz/request_corpus
build-fuzz/request_fuzz -max_total_time="$request_fuzz_seconds" -max_len=65536 -dict=fuzz/request.dict \
  -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 build-fuzz/request_corpus fuzz/request_corpus

step "all checks passed"
total=0 failed=0 skipped=0
for log in "${ctest_logs[@]}"; do
  line="$(grep -E 'tests passed, [0-9]+ tests failed out of [0-9]+' "$log" | tail -n 1)"
  total=$((total + $(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")))
  failed=$((failed + $(sed -E 's/.*passed, ([0-9]+) tests failed.*/\1/' <<<"$line")))
  skipped=$((skipped + $(grep -c '(Skipped)' "$log" || true)))
  rm -f "$log"
done
# GPU tests report as skipped on machines without a GPU.
echo "summary: $((total - failed - skipped)) passed, $failed failed, $skipped skipped"
