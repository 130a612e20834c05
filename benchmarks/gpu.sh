#!/usr/bin/env bash
# The engine's tables on one CUDA GPU, in one run: bash benchmarks/gpu.sh smoke|full [OUT_DIR]
#
# Run from the repository root on a machine with one CUDA GPU and a python3 that has torch, lightning and
# torchmetrics (PYTHONPATH=. is set here: no install needed). `smoke` runs every script at a reduced size
# (does each work on the GPU?); `full` prints the tables of docs/benchmarks.md's GPU section. Each script's
# whole output goes to OUT_DIR/<name>.log (default $OUT, else /tmp/gpu_tables), a summary to the terminal.
# The official FedRep code (github.com/lgcollins/FedRep) is read from $OFFICIAL (default .official/).
set -u
mode=${1:-smoke}
out=${2:-${OUT:-/tmp/gpu_tables}}
official=${OFFICIAL:-.official}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1

run() {  # run NAME SECONDS SCRIPT ARGS...: one script under a time limit, its log and its last lines
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$py" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name (rc $rc, $((SECONDS - start)) s): $*"
    grep -v -e "^GPU available" -e "^TPU available" -e "Tip:" -e "LOCAL_RANK" -e "^lightning_fedrep:" \
        -e "stopped: " -e "Warning" -e "warn" "$out/$name.log" | tail -n "${TAIL:-30}"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c "import torch, lightning, torchmetrics; print('torch', torch.__version__, 'lightning', lightning.__version__, 'torchmetrics', torchmetrics.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$out/machine.log"

case $mode in
smoke)
    run device_check 120 benchmarks/engine/device_check.py --device cuda
    run cifar_round 90 benchmarks/engine/cifar_round.py --small --device cuda
    run compiled_head_phase 90 benchmarks/engine/compiled_head_phase.py --small --device cuda
    run official_round 90 benchmarks/engine/official_round.py --official "$official" --small --repeats 1 --device cuda
    run finetuned_evaluation 90 benchmarks/srpfl/finetuned_evaluation.py --clients 4 --repeats 1 --device cuda
    run overhead 90 benchmarks/overhead.py --rounds 1 --repeats 1 --device cuda
    run auto_choice 90 benchmarks/engine/auto_choice.py --small --models mlp --runs 1 --device cuda
    run first_round 60 benchmarks/engine/first_round.py --small --model mlp --device cuda
    ;;
full)
    run cifar_round 200 benchmarks/engine/cifar_round.py --full --repeats 2 --device cuda
    run official_round 80 benchmarks/engine/official_round.py --official "$official" --repeats 2 --device cuda
    run finetuned_evaluation 60 benchmarks/srpfl/finetuned_evaluation.py --repeats 2 --device cuda
    run overhead 100 benchmarks/overhead.py --rounds 10 --repeats 2 --device cuda
    run compiled_head_step 60 benchmarks/engine/compiled_head_step.py --device cuda
    run compiled_head_phase 120 benchmarks/engine/compiled_head_phase.py --device cuda
    run auto_choice 100 benchmarks/engine/auto_choice.py --models cnn --runs 3 --device cuda
    run auto_choice_mlp 110 benchmarks/engine/auto_choice.py --models mlp --runs 3 --mlp-rounds 11 --device cuda
    run first_round 90 benchmarks/engine/first_round.py --runs 3 --device cuda
    # sample-level DP-SGD against Opacus (pure Python: put a copy on PYTHONPATH where the machine lacks it)
    if "$py" -c "import opacus" 2>/dev/null; then
        run sample_level_speed 300 benchmarks/privacy/sample_level_speed.py --repeats 3 --device cuda
    else
        echo "=== sample_level_speed skipped: opacus is not importable (copy it to a folder on PYTHONPATH)"
    fi
    # dropout on the vectorized runner (randomness="per_client") against the sequential runner
    run dropout_round 120 benchmarks/engine/dropout_round.py --device cuda
    # a tiny transformer's LoRA round and its store (transformers and peft: put copies on PYTHONPATH if missing)
    if "$py" -c "import transformers, peft" 2>/dev/null; then
        run lora_round 240 benchmarks/transformers/lora_round.py --device cuda --clients 64 --randomness per_client
    else
        echo "=== lora_round skipped: transformers and peft are not importable (copy them to a folder on PYTHONPATH)"
    fi
    ;;
*)
    echo "usage: bash benchmarks/gpu.sh smoke|full [OUT_DIR]" >&2
    exit 2
    ;;
esac
