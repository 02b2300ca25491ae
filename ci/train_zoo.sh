#!/usr/bin/env bash
# GPU training of the model zoo on the device machine (one call = the stages in ZOO_STAGES).
#
# Expects the staged inputs built on CPU by `python -m eagle3_train.build_data --out .stage`
# and carried in .stage/ (see atom_like/zoo/README.md for which paths each call carries).
# Results land in $OUT: zoo_report.txt and zoo-$ZOO_TAG.tar.gz.partNN (15 MiB each);
# reassemble with `cat zoo-*.tar.gz.part* | tar xz`.
#
#   ZOO_STAGES=tiny-target,tiny-regen,tiny-drafts ci/train_zoo.sh      # call 1
#   ZOO_STAGES=smol-convert,smol-regen,smol-draft ci/train_zoo.sh      # call 2
#
# Budgets (minutes): ZOO_TARGET_MIN=5 ZOO_TINY_REGEN_MIN=0.5 ZOO_TINY_DRAFT_MIN=2 (each, run in
# parallel unless ZOO_PARALLEL=0) ZOO_SMOL_REGEN_MIN=1 ZOO_SMOL_DRAFT_MIN=5; every stage is
# trimmed to fit ZOO_DEADLINE_MIN=9.3 (the device allows 10 minutes a command).
# Extra arguments: ZOO_TARGET_ARGS (train_target), ZOO_DRAFT_ARGS (train_eagle3), ZOO_SMOL_INIT
# (continue the SmolLM2 draft from a checkpoint), ZOO_SMOL_DRAFT_VOCAB (default 24576).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/zoo-out}"
export ZOO_WORK="${ZOO_WORK:-/tmp/zoo_work}"
# transformers reads the SmolLM2 GGUF through the pure-Python `gguf` package, which the GPU
# image lacks: the staged copy (or one stashed by an earlier call) goes on the path first.
for d in "$PWD"/.stage/gguf-a "$PWD"/.stage/gguf-b "$ZOO_WORK/gguf"; do
  if [ -d "$d/pylib/gguf" ]; then export PYTHONPATH="$d/pylib:$PWD:${PYTHONPATH:-}"; break; fi
done
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
exec python3 -m eagle3_train.train_zoo
