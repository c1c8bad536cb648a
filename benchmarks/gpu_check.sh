#!/usr/bin/env bash
# Every GPU path of the project in one unattended run on one CUDA GPU, in about 5 minutes:
#
#     bash benchmarks/gpu_check.sh OUT_DIR             # on a machine with a CUDA GPU
#     bash benchmarks/gpu_check.sh OUT_DIR --dry-run   # on the CPU, small shapes: checks the script
#
# Each section runs on its own: one that fails is recorded with its last error line and the next
# one runs; one whose input failed, or that would start after the time budget is spent, is
# recorded as skipped, with the reason. The budget (GPU_CHECK_BUDGET seconds) is 300 by default,
# 1800 for --dry-run, where every section must run on a slower CPU. The sections that decide most
# (host syncs, bfloat16, attention kernels) run first. Nothing is downloaded (HF_HUB_OFFLINE,
# TRANSFORMERS_OFFLINE). OUT_DIR (new or empty) receives four files:
#   gpu_check.json  each section: ran / skipped (why) / failed (one line), its seconds and figures
#   gpu_check.log   every command and everything it printed
#   latency.png     the forward latency curves (the `latency` section)
#   serve_load.png  serve.py's output tokens/s against concurrent streams (the `serve_load` section)
# Scratch (models, checkpoints) goes to a temporary folder, deleted at the end.
# GPU_CHECK_SCALE multiplies every section's time limit (a slow or busy machine; default 1, 3 for
# --dry-run).
set -u
OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [--dry-run]}
DRY=${2:-}
cd "$(dirname "$0")/.."
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "gpu_check.sh: error: $OUT is not an empty folder; name a new one" >&2
  exit 2
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$W"' EXIT
LOG=$OUT/gpu_check.log PY=${PYTHON:-python3}
if [ "$DRY" = "--dry-run" ]; then
  DEV=cpu SMALL=(--small) TESTS=(-m gpu)       # the gpu-marked tests, on the CPU
  BUDGET=${GPU_CHECK_BUDGET:-1800} SCALE=${GPU_CHECK_SCALE:-3}
else
  DEV=cuda SMALL=() TESTS=()
  BUDGET=${GPU_CHECK_BUDGET:-300} SCALE=${GPU_CHECK_SCALE:-1}
  export MTP_GPU_TESTS=1                 # tests/conftest.py: only the gpu-marked tests, on CUDA
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # everything it reads is made here
: > "$LOG"
: > "$W/sections.jsonl"
START=$(date +%s)

record() {   # record NAME STATUS SECONDS NOTE: one line of sections.jsonl
  "$PY" -c 'import json, sys
name, status, seconds, note = sys.argv[1:]
line = {"section": name, "status": status, "seconds": float(seconds)}
print(json.dumps({**line, "note": note} if note else line))' "$@" >> "$W/sections.jsonl"
}

# section NAME TIME_LIMIT_S NEEDS COMMAND...: run it, log it, record how it went. NEEDS names a
# section that must have run first, or is -.
section() {
  local name=$1 limit=$(($2 * SCALE)) needs=$3 left=$((BUDGET - $(date +%s) + START)) t0 rc
  shift 3
  local ran="\"section\": \"$needs\", \"status\": \"ran\""
  if [ "$needs" != - ] && ! grep -q "$ran" "$W/sections.jsonl"; then
    echo "=== $name: skipped (needs $needs, which did not run)" >> "$LOG"
    record "$name" skipped 0 "needs $needs, which did not run"
    return
  fi
  if [ "$left" -le 10 ]; then
    echo "=== $name: skipped (time budget spent)" >> "$LOG"
    record "$name" skipped 0 "the time budget of ${BUDGET}s was spent"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s): $*" >> "$LOG"
  t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@" > "$W/$name.out" 2>&1
  rc=$?
  cat "$W/$name.out" >> "$LOG"
  local seconds=$(( ($(date +%s%N) - t0) / 1000000 ))e-3
  case $rc in
    0) record "$name" ran "$seconds" "" ;;
    124|137|143) record "$name" failed "$seconds" "timed out after ${limit}s" ;;
    *) local last=$(grep -v '^\s*$' "$W/$name.out" | tail -n 1 | cut -c1-300)
       record "$name" failed "$seconds" "exit $rc: $last" ;;
  esac
  echo "=== $name: exit $rc" >> "$LOG"
}

FIG=("$PY" benchmarks/gpu_figures.py --device "$DEV" "${SMALL[@]}")
FT=("$PY" finetune_hf.py)
SMOKE=$W/smoke
TRAIN=(--data "$W/wp/train.json" --seq-len 64 --batch-size 16 --micro-batch 8 --lr 3e-4 --warmup 5
       --regions 8 --k-max 4 --save-every 10 --log-every 5 --device "$DEV")

# 1. The machine; what decides most: host syncs per decoding pass, what holds in bfloat16, the
#    attention kernel of each call shape (each case on its own); then the opt-in GPU tests (no
#    -x: every failure is counted).
section env 60 - bash -c 'nvidia-smi || true; "$@"' _ "${FIG[@]}" env --json "$W/env.json"
section syncs 60 - "${FIG[@]}" syncs --json "$W/syncs.json"
section bf16 60 - "${FIG[@]}" bf16 --json "$W/bf16.json"
section kernels 90 - "${FIG[@]}" kernels --json "$W/kernels.json"
section gpu_tests 150 - "$PY" -m pytest -q tests "${TESTS[@]}" -p no:cacheprovider \
  --junitxml "$W/gpu_tests.xml"
# 2. Figures: forward latency, decoding speed, a training step.
section latency 90 - "${FIG[@]}" latency --json "$W/latency.json"
section decode 60 - "${FIG[@]}" decode --json "$W/decode.json"
section train_step 90 - "${FIG[@]}" train_step --json "$W/train_step.json"
# 3. finetune_hf.py on a grouped-query smoke model: train, interrupted + resumed, export, eval,
#    FSDP2 under torchrun (NCCL on a GPU, gloo on the CPU).
WRITE_WP="import sys; from tasks.word_problems import write_word_problems; write_word_problems(sys.argv[1], n_train=512, n_test=32)"
section smoke_model 30 - bash -c '"$1" benchmarks/gpu_figures.py smoke_model "$2" &&
  "$1" -c "$3" "$4"' \
  _ "$PY" "$SMOKE" "$WRITE_WP" "$W/wp"
section ft_train 60 smoke_model "${FT[@]}" train --model "$SMOKE" "${TRAIN[@]}" --steps 20 \
  --out "$W/full"
section ft_resume 90 smoke_model bash -c '"$@" --steps 10 --out "$0" &&
  "$@" --steps 20 --out "$0" --resume' "$W/cut" "${FT[@]}" train --model "$SMOKE" "${TRAIN[@]}"
section ft_resume_diff 30 ft_resume "${FIG[@]}" compare "$W/full/final" "$W/cut/final" \
  --json "$W/ft_resume_diff.json"
section ft_export 60 ft_train "${FT[@]}" export --checkpoint "$W/full" --out "$W/exported"
section ft_eval 90 ft_train "${FT[@]}" eval --model "$W/full/final" --data "$W/wp/test.jsonl" \
  --out "$W/eval" --prompt-style zeroshot --limit 32 --max-new-tokens 48 --batch-size 16 \
  --static-k 1 3 --taus 0.9 --lossless-k 4 --device "$DEV"
section fsdp_train 120 smoke_model "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
  finetune_hf.py train --model "$SMOKE" "${TRAIN[@]}" --steps 20 --out "$W/fsdp"
section fsdp_diff 30 fsdp_train "${FIG[@]}" compare "$W/full/final" "$W/fsdp/final" \
  --json "$W/fsdp_diff.json"
# the gated mask adapter: its step (ground truth once into a KV cache, then the mask slots) under
# torchrun, its frozen base whole (--shard-base auto on one GPU) and sharded (FSDP2), then its
# lossless decoding (a float32 adapter on the base in the GPU's dtype)
section adapter_train 120 smoke_model "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node 1 finetune_hf.py train --model "$SMOKE" "${TRAIN[@]}" --steps 20 \
  --adapter gated-lora --out "$W/adapter"
section adapter_sharded 120 smoke_model "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node 1 finetune_hf.py train --model "$SMOKE" "${TRAIN[@]}" --steps 20 \
  --adapter gated-lora --shard-base yes --out "$W/adapter_sharded"
section adapter_decode 60 adapter_train "$PY" confadapt.py --model "$W/adapter/final" \
  --device "$DEV" --prompt "Tom has 3 apples." --lossless --k-max 4 --json
section adapter_lookup 60 adapter_train "$PY" confadapt.py --model "$W/adapter/final" \
  --device "$DEV" --prompt "Tom has 3 apples." --lossless --lookup --k-max 4 --json
# what one lossless pass with the adapter costs against the base's one-token pass (on a GPU every
# small product of the adapter is a kernel launch): the trained one, and a fresh rank 16 on q, v
section adapter_pass 60 adapter_train bash -c '"$@" --model "$0/adapter/final" --out "$0/pass/trained" &&
  "$@" --model "$0/smoke" --rank 16 --targets wq wv --out "$0/pass/qv16"' "$W" "$PY" \
  benchmarks/adapter_pass.py --device "$DEV"
# 4. Decoding through the command lines.
section confadapt 60 ft_train "$PY" confadapt.py --model "$W/full/final" --device "$DEV" \
  --prompt "Tom has 3 apples." --tau 0.9 --k-max 4 --json
section decode_real 150 ft_train "$PY" benchmarks/decode_real.py --model "$W/full/final" \
  --out "$W/decode_real" --device "$DEV" --quick --k-max 4
# 5. serve.py on the device, under 1, 4 and 16 streams of the openai client (the load-aware rule
#    times its passes there at start-up and learns their costs as it runs).
section serve_load 120 ft_train "$PY" benchmarks/serve_load.py --model "$W/full/final" \
  --device "$DEV" --out "$W/serve" --concurrency 1 4 16 --max-tokens 32 --prompts-per-domain 1 \
  --requests-per-stream 1 --modes greedy confadapt confadapt-off lossless
# 6. train_toy.py end to end (the laptop users' command, --quick), last: the longest.
section train_toy 180 - "$PY" train_toy.py --device "$DEV" --quick --out "$W/toy"

"$PY" - "$OUT" "$W" "$DRY" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
out, work, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "--dry-run"
sections = [json.loads(line) for line in open(os.path.join(work, "sections.jsonl"))]
for s in sections:
    path = os.path.join(work, s["section"] + ".json")
    if os.path.isfile(path):
        s["figures"] = json.load(open(path))
tests = os.path.join(work, "gpu_tests.xml")
if os.path.isfile(tests):
    root = ET.parse(tests).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = []
    for case in suite.iter("testcase"):
        for bad in case:
            if bad.tag in ("failure", "error"):
                message = (bad.get("message") or "").strip().split("\n")[0]
                failed.append(f"{case.get('name')}: {message[:200]}")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    by_name = {s["section"]: s for s in sections}
    by_name["gpu_tests"]["figures"] = {**counts, "failed": failed}
for name, file in (("decode_real", "decode_real/results.json"), ("train_toy", "toy/results.json"),
                   ("serve_load", "serve/results.json")):
    path = os.path.join(work, file)
    if os.path.isfile(path):
        r = json.load(open(path))
        if name == "decode_real":
            keep = r.get("decoding")
        elif name == "serve_load":
            keep = [{k: p.get(k) for k in ("concurrency", "decoder", "tokens_per_second",
                                           "tokens_per_pass", "k_mean")} for p in r["phases"]]
        else:
            keep = {k: r.get(k) for k in ("seconds", "device", "quick")}
        next(s for s in sections if s["section"] == name)["figures"] = keep
passes = {n: os.path.join(work, "pass", n, "adapter_pass.json") for n in ("trained", "qv16")}
if any(os.path.isfile(f) for f in passes.values()):
    next(s for s in sections if s["section"] == "adapter_pass")["figures"] = {
        n: {k: json.load(open(f))[k] for k in ("ms", "ratios")}
        for n, f in passes.items() if os.path.isfile(f)}
if os.path.isfile(os.path.join(work, "serve", "load.png")):
    import shutil
    shutil.copy(os.path.join(work, "serve", "load.png"), os.path.join(out, "serve_load.png"))
latency = os.path.join(work, "latency.json")
if os.path.isfile(latency):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = json.load(open(latency))
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (shape, c) in zip(axes[0], curves.items()):
        for batch, points in c["ms"].items():
            sizes = [int(t) for t in points]
            ax.plot(sizes, list(points.values()), marker=".", label=f"batch {batch}")
        ax.set(title=f"{shape} shape, {c['layers']} layers, {c['dtype']}",
               xlabel="new positions per row", ylabel="ms per forward pass")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "latency.png"), dpi=110)
ran = sum(s["status"] == "ran" for s in sections)
report = {"dry_run": dry, "ran": ran, "sections": sections}
json.dump(report, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
for s in sections:
    print(f"{s['section']:15s} {s['status']:8s} {s['seconds']:7.1f} s  {s.get('note', '')}")
print(f"{ran}/{len(sections)} sections ran; {out}/gpu_check.json, {out}/gpu_check.log")
EOF
