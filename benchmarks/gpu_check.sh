#!/usr/bin/env bash
# Every GPU path of the project in one unattended run on one CUDA GPU, in under 8 minutes:
#
#     bash benchmarks/gpu_check.sh OUT_DIR             # on a machine with a CUDA GPU
#     bash benchmarks/gpu_check.sh OUT_DIR --dry-run   # the same steps on the CPU, tiny: checks the script
#
# Writes OUT_DIR/gpu_check.log (every command and its output) and OUT_DIR/gpu_check.json (each
# step's status, seconds and figures). Each step is timed and logged; a failing step is recorded
# and the next one runs; once the time budget (GPU_CHECK_BUDGET seconds, default 450) is spent,
# the remaining steps are recorded as skipped. Figures come from benchmarks/gpu_figures.py.
# GPU_CHECK_SCALE multiplies every step's limit (a slow or busy machine, e.g. for --dry-run).
set -u
OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [--dry-run]}
DRY=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/work/figures" && OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log W=$OUT/work FIG=$OUT/work/figures PY=${PYTHON:-python}
BUDGET=${GPU_CHECK_BUDGET:-450} SCALE=${GPU_CHECK_SCALE:-1}
: > "$LOG"; : > "$W/steps.jsonl"
if [ "$DRY" = "--dry-run" ]; then
  DEV=cpu DT=float32 TOY=(--quick) TESTS=(-m gpu -x)
else
  DEV=cuda DT=bfloat16 TOY=() TESTS=(-x)
  export MTP_GPU_TESTS=1                       # tests/conftest.py: only the gpu-marked tests, on CUDA
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
START=$(date +%s)

step() {   # step NAME TIMEOUT_S COMMAND...: run it, log it, record its status and seconds
  local name=$1 limit=$(($2 * SCALE)) left=$((BUDGET - $(date +%s) + START)) t0 rc status
  shift 2
  if [ "$left" -le 5 ]; then
    echo "=== $name: skipped (time budget spent)" >> "$LOG"
    echo "{\"step\": \"$name\", \"status\": \"skipped\", \"seconds\": 0}" >> "$W/steps.jsonl"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s): $*" >> "$LOG"
  t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  echo "=== $name: $status (exit $rc)" >> "$LOG"
  echo "{\"step\": \"$name\", \"status\": \"$status\", \"exit\": $rc, \"seconds\": $(( ($(date +%s%N) - t0) / 1000000 ))e-3}" \
    >> "$W/steps.jsonl"
}

FT=("$PY" finetune_hf.py)     # `timeout` runs programs, not shell functions: commands are arrays
WP=$W/wp TRAIN=(--data "$W/wp/data/train.json" --seq-len 64 --batch-size 16 --micro-batch 8 --lr 3e-4 --warmup 5
                --regions 8 --save-every 10 --log-every 5 --device "$DEV")

# 1. the machine, then the opt-in GPU tests (parity with transformers in float32 and bfloat16;
#    cached, ragged and uncached passes agree; generate equals the uncached reference)
step env 60 bash -c 'nvidia-smi; "$0" benchmarks/gpu_figures.py env --device "$1" --json "$2"' "$PY" "$DEV" "$FIG/env.json"
step gpu_tests 150 "$PY" -m pytest -q tests "${TESTS[@]}" -p no:cacheprovider --junitxml "$FIG/gpu_tests.xml"
# 2. kernels, memory, host syncs
step attention 60 "$PY" benchmarks/gpu_figures.py attention --device "$DEV" --dtype "$DT" --json "$FIG/attention.json"
step syncs 60 "$PY" benchmarks/gpu_figures.py syncs --device "$DEV" --dtype "$DT" --json "$FIG/syncs.json"
# 3. finetune_hf.py on the word-problem miniature: train, interrupted + resumed, export, eval, analyze
step wp_base 60 "$PY" train_toy.py --word-problems "$WP" --quick --device "$DEV"
Q=$("$PY" -c "import json, sys; print(json.loads(open(sys.argv[1]).readline())['question'])" "$WP/data/test.jsonl" \
    2>/dev/null || echo "Tom has 3 apples.")
step ft_train 60 "${FT[@]}" train --model "$WP/base" "${TRAIN[@]}" --steps 20 --out "$W/full"
step ft_train_half 60 "${FT[@]}" train --model "$WP/base" "${TRAIN[@]}" --steps 10 --out "$W/cut"
step ft_resume 60 "${FT[@]}" train --model "$WP/base" "${TRAIN[@]}" --steps 20 --out "$W/cut" --resume
step ft_resume_diff 30 "$PY" benchmarks/gpu_figures.py compare "$W/full/final" "$W/cut/final" --json "$FIG/ft_resume_diff.json"
step ft_export 60 "${FT[@]}" export --checkpoint "$W/full" --out "$W/exported"
step ft_export_diff 30 "$PY" benchmarks/gpu_figures.py compare "$W/full/final" "$W/exported" --json "$FIG/ft_export_diff.json"
step ft_eval 90 "${FT[@]}" eval --model "$W/full/final" --data "$WP/data/test.jsonl" --out "$W/eval" --prompt-style zeroshot \
  --limit 32 --max-new-tokens 48 --batch-size 16 --static-k 1 3 --taus 0.9 --lossless-k 4 --device "$DEV"
step ft_analyze 60 "${FT[@]}" analyze --model "$WP/base" --data "$WP/data/test.jsonl" --limit 16 --max-new-tokens 48 \
  --out "$W/analysis" --device "$DEV"
# 4. FSDP2 under torchrun at world size 1 (NCCL on a GPU, gloo on the CPU), against the plain run
step fsdp_train 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 finetune_hf.py train \
  --model "$WP/base" "${TRAIN[@]}" --steps 20 --out "$W/fsdp"
step fsdp_diff 30 "$PY" benchmarks/gpu_figures.py compare "$W/full/final" "$W/fsdp/final" --json "$FIG/fsdp_diff.json"
# 5. decoding on the tuned miniature in bfloat16: confadapt.py and its bench
step confadapt 60 bash -c '"$0" confadapt.py --model "$1" --device "$2" --dtype "$3" --json --prompt "$4" > "$5"' \
  "$PY" "$W/full/final" "$DEV" "$DT" "$Q" "$FIG/confadapt.json"
step bench 90 bash -c '"$0" benchmarks/bench_modes.py --model "$1" --device "$2" --dtype "$3" --json --prompt "$4" \
  --max-new-tokens 48 --batch-sizes 1 16 --taus 0.9 --repeats 2 --latency-max 16 > "$5"' \
  "$PY" "$W/full/final" "$DEV" "$DT" "$Q" "$FIG/bench.json"
step bf16 60 "$PY" benchmarks/gpu_figures.py bf16 --device "$DEV" --dtype "$DT" --json "$FIG/bf16.json"
step decode 60 "$PY" benchmarks/gpu_figures.py decode --device "$DEV" --dtype "$DT" --json "$FIG/decode.json"
# ... and every decoder against transformers' greedy and prompt lookup, with the latency curve
step decode_real 120 "$PY" benchmarks/decode_real.py --model "$W/full/final" --out "$W/decode_real" --device "$DEV" \
  --dtype "$DT" --quick --k-max 4
# 6. train_toy.py end to end (the laptop users' command), last: the longest step
step train_toy 240 "$PY" train_toy.py --device "$DEV" --out "$W/toy" "${TOY[@]}"

"$PY" - "$OUT" "$DRY" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
out, dry = sys.argv[1], sys.argv[2] == "--dry-run"
fig = os.path.join(out, "work", "figures")
steps = [json.loads(line) for line in open(os.path.join(out, "work", "steps.jsonl"))]
figures = {}
for name in sorted(os.listdir(fig)):
    path = os.path.join(fig, name)
    try:
        if name.endswith(".json"):
            figures[name[:-5]] = json.load(open(path))
        elif name.endswith(".xml"):
            s = ET.parse(path).getroot()
            s = s if s.tag == "testsuite" else s.find("testsuite")
            figures["gpu_tests"] = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (ValueError, ET.ParseError, AttributeError) as e:
        figures[name] = f"unreadable: {e}"
toy = os.path.join(out, "work", "toy", "results.json")
if os.path.isfile(toy):
    r = json.load(open(toy))
    figures["train_toy"] = {k: r.get(k) for k in ("seconds", "device", "acceptance", "quick")}
real = os.path.join(out, "work", "decode_real", "results.json")
if os.path.isfile(real):
    r = json.load(open(real))
    figures["decode_real"] = {"decoding": [{k: d[k] for k in ("batch_size", "mode", "tokens_per_second", "speedup",
                                                               "effective_k", "equals_greedy")} for d in r["decoding"]],
                              "latency_ms": r["latency_ms"]}
report = {"dry_run": dry, "ok": sum(s["status"] == "ok" for s in steps), "steps": steps, "figures": figures}
json.dump(report, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print(f"{report['ok']}/{len(steps)} steps ok; {out}/gpu_check.json, {out}/gpu_check.log")
EOF
