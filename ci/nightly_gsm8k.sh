#!/usr/bin/env bash
# Nightly GSM8K gate (ATOM's accuracy + acceptance CI), one server and one report per entry.
#
#   ci/nightly_gsm8k.sh                      # every catalog entry this machine can run
#   ci/nightly_gsm8k.sh smollm2-135m smollm2-135m-eagle3
#   OUT_DIR=reports GSM8K_ARGS="--limit 200" ci/nightly_gsm8k.sh
#   GSM8K_COMPARE="--no-enable-prefix-caching" ci/nightly_gsm8k.sh smollm2-135m-eagle3
#
# GSM8K_COMPARE="FLAGS" runs every entry twice, on a fresh server each time: first with FLAGS
# added to its server flags (report ENTRY.compare.json), then as catalogued (ENTRY.json). The
# summary pairs each run with the first run of its entry (same completions, same answers) and
# prints every run side by side (accuracy, acceptance, prefix-cache hit rate, TTFT, throughput);
# it is also written to $OUT_DIR/summary.md.
# Exit status: 0 when every entry passed; otherwise the worst entry's status
# (1 threshold missed, 2 run failed, 3 needs hardware we lack).
set -uo pipefail
cd "$(dirname "$0")/.."

CATALOG=${CATALOG:-ci/gsm8k_catalog.json}
OUT_DIR=${OUT_DIR:-gsm8k_reports/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"

if [ "$#" -gt 0 ]; then
  entries=("$@")
else
  # entries without a `requires` note: the ones whose hardware we have
  mapfile -t entries < <(python -c "import json, sys; print('\n'.join(e['name'] for e in json.load(open(sys.argv[1]))['entries'] if not e.get('requires')))" "$CATALOG")
fi

status=0
reports=()
run_entry() {  # run_entry ENTRY REPORT [EXTRA_SERVER_FLAGS]
  echo "=== gsm8k $1${3:+ [$3]}"
  # shellcheck disable=SC2086  # GSM8K_ARGS is a list of flags
  python -m atom_like.eval.gsm8k --catalog "$CATALOG" --entry "$1" --output "$2" ${3:+"--server-args=$3"} ${GSM8K_ARGS:-}
  local code=$?
  [ -f "$2" ] && reports+=("$2")
  [ "$code" -gt "$status" ] && status=$code
}
for entry in "${entries[@]}"; do
  [ -n "${GSM8K_COMPARE:-}" ] && run_entry "$entry" "$OUT_DIR/$entry.compare.json" "$GSM8K_COMPARE"
  run_entry "$entry" "$OUT_DIR/$entry.json"
done

echo "=== summary ($OUT_DIR)"
[ "${#reports[@]}" -gt 0 ] && python -m atom_like.eval.gsm8k --summarize "${reports[@]}" | tee "$OUT_DIR/summary.md"
exit "$status"
