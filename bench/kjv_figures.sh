#!/usr/bin/env bash
# The paper's two figures in miniature on the committed King James Bible (docs/head_to_head.md).
#
#   bash bench/kjv_figures.sh train   # (a) Megalodon vs Llama, same tokens/optimiser/data order, seeds $SEEDS
#   bash bench/kjv_figures.sh context # (b) validation perplexity vs context length from the seed-$CTX_SEED checkpoints
#   bash bench/kjv_figures.sh passkey # (c) passkey retrieval at 1K ... 64K tokens from the seed-$CTX_SEED checkpoints
#   bash bench/kjv_figures.sh all     # (a), (b) and (c)
#
# Each seed's Megalodon and Llama run side by side (two processes, one thread each) so that their wall
# times are measured under the same load. Runs go to $RUN_ROOT/<arch>-s<seed>/kjv/<time>/ (TensorBoard
# reads them all: `tensorboard --logdir $RUN_ROOT`); tables and plots to $OUT.
# Knobs (environment): DATA_DIR, SEEDS, STEPS, BATCH, SEQ_LEN, CONTEXTS, EVAL_DOCS, PASSKEY_LENGTHS,
# PASSKEY_SAMPLES, RUN_ROOT, OUT, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
RUN_ROOT=${RUN_ROOT:-runs/head_to_head}
OUT=${OUT:-docs/figures}
SEEDS=${SEEDS:-"1 2"}
CTX_SEED=${CTX_SEED:-1}
STEPS=${STEPS:-100}
BATCH=${BATCH:-4}
SEQ_LEN=${SEQ_LEN:-1024}
# Ezekiel, the longest validation book, is 54,112 tokens: 512 ... 16K, then the whole book (each context
# length is a full pass over the book, so the list is kept short on a CPU).
CONTEXTS=${CONTEXTS:-"[512,1024,4096,16384,54112]"}
EVAL_DOCS=${EVAL_DOCS:-1}
# Passkey prompts: haystacks of the held-out (validation) books, the needle 10% ... 90% deep.
PASSKEY_LENGTHS=${PASSKEY_LENGTHS:-"[1024,2048,4096,8192,16384,32768,65536]"}
PASSKEY_SAMPLES=${PASSKEY_SAMPLES:-5}
DATA_DIR=${DATA_DIR:-data}
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1

# Identical for both architectures: data (and its order, from the seed), optimiser, schedule, steps.
COMMON=(
  recipe=kjv data.data_dir="$DATA_DIR" data.batch_size="$BATCH" data.options.seq_len="$SEQ_LEN"
  trainer.max_steps="$STEPS" optim.warmup_steps=10 trainer.log_every_n_steps=2
  trainer.val_check_interval="$STEPS" trainer.limit_val_batches=8 trainer.limit_test_batches=8
  trainer.progress_bar=false
)

latest() { ls -d "$RUN_ROOT/$1/kjv"/*/ | sort | tail -1; }

# Wait for every background job; stop with the logs to read if one failed.
wait_all() {
  local pid failed=0
  for pid in $(jobs -p); do wait "$pid" || failed=1; done
  if [ "$failed" = 1 ]; then echo "error: a run failed; see $RUN_ROOT/*.log" >&2; exit 1; fi
}

train() {
  mkdir -p "$RUN_ROOT" "$OUT"
  # Unpack and tokenise once, before two processes would race for it.
  "$PYTHON" -c "from datamodules.kjv import KJVDataModule as D; D('$DATA_DIR').prepare_data()"
  local dirs=()
  for seed in $SEEDS; do
    for arch in megalodon llama; do
      "$PYTHON" run.py "${COMMON[@]}" model.arch=$arch seed="$seed" run_root="$RUN_ROOT/$arch-s$seed" \
        > "$RUN_ROOT/$arch-s$seed.log" 2>&1 &
    done
    wait_all
    for arch in megalodon llama; do dirs+=("$(latest "$arch-s$seed")"); done
  done
  "$PYTHON" -m mega_suite.evaluation.compare "${dirs[@]}" --group-by-seed --out "$OUT/loss_vs_tokens"
}

context() {
  mkdir -p "$OUT"
  for arch in megalodon llama; do
    local run
    run=$(latest "$arch-s$CTX_SEED")
    "$PYTHON" run.py "${COMMON[@]}" model.arch=$arch mode=eval_context ckpt="$run/checkpoints/last.ckpt" \
      eval_context_lengths="$CONTEXTS" eval_max_documents="$EVAL_DOCS" \
      run_root="$RUN_ROOT/context-$arch" > "$RUN_ROOT/context-$arch.log" 2>&1 &
  done
  wait_all
  "$PYTHON" -m bench.context_figure "$(latest context-megalodon)" "$(latest context-llama)" \
    --out "$OUT/ppl_vs_context"
}

passkey() {
  mkdir -p "$OUT"
  for arch in megalodon llama; do
    local run
    run=$(latest "$arch-s$CTX_SEED")
    "$PYTHON" run.py recipe=kjv data.data_dir="$DATA_DIR" mode=passkey ckpt="$run" trainer.accelerator=cpu \
      passkey.lengths="$PASSKEY_LENGTHS" passkey.samples="$PASSKEY_SAMPLES" \
      passkey.haystack="$DATA_DIR/kjv/validation" run_root="$RUN_ROOT/passkey-$arch" \
      > "$RUN_ROOT/passkey-$arch.log" 2>&1 &
  done
  wait_all
  "$PYTHON" -m mega_suite.evaluation.passkey "$(latest passkey-megalodon)" "$(latest passkey-llama)" \
    --out "$OUT/passkey"
}

case "${1:-all}" in
  train) train ;;
  context) context ;;
  passkey) passkey ;;
  all) train && context && passkey ;;
  *) echo "usage: $0 [train|context|passkey|all]" >&2; exit 2 ;;
esac
