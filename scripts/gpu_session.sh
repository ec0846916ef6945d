#!/usr/bin/env bash
# One device call for issue 44's GPU targets, prepared and tested on the CPU (with DRY=1: tiny
# budgets, the CPU). Run from the repository root on the GPU machine, carrying .whl:
#
#     bash scripts/gpu_session.sh            # ~450 s: step breakdown, batch_update, 2 seeds
#
# 1. benchmarks/step_breakdown.py and batch_update.py for pong_appo at B=4, with the weights
#    published after every step and once per batch (algorithm.broadcast_every=null);
# 2. `impala train pong_appo seed=S` with no other override but the budget, seeds 1 and 2:
#    the whole process's wall time to the first epoch with a training return >= 18 (start-up
#    included), printed per seed. Everything it prints and the runs' metrics go to $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu-session}"
mkdir -p "$OUT"
if [ "${DRY:-0}" = 1 ]; then
    DEVICE=cpu; WALL=20; BATCHES=1; B="algorithm.actors_batch_size=1 algorithm.envs_per_actor=4"
    IMPALA_PYTHON="${IMPALA_PYTHON:-.venv/bin/python}"
else
    source scripts/device_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
    DEVICE=cuda; WALL=150; BATCHES=10; B="algorithm.actors_batch_size=4 algorithm.envs_per_actor=8"
    nvidia-smi --query-gpu=name --format=csv,noheader
fi
PY="${IMPALA_PYTHON:-python3}"
for every in 1 null; do
    timeout 120 "$PY" benchmarks/step_breakdown.py pong_appo algorithm.device=$DEVICE $B \
        algorithm.broadcast_every=$every --batches $BATCHES 2>&1 | tail -9
    timeout 120 "$PY" benchmarks/batch_update.py pong_appo algorithm.device=$DEVICE $B \
        algorithm.broadcast_every=$every --repeats $BATCHES 2>&1 | tail -1
done
for seed in 1 2; do
    run="$OUT/pong_appo-seed$seed"
    start=$(date +%s.%N)
    timeout $((WALL + 90)) "$PY" -m impala_rl.cli train pong_appo seed=$seed target_return=null \
        max_wall_time_s=$WALL log.console=false --run-dir "$run" > "$run.log" 2>&1
    end=$(date +%s.%N)
    "$PY" - "$run" "$start" "$end" <<'PY'
import json, sys
run, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
summary = json.load(open(f"{run}/summary.json"))
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
startup = (end - start) - summary["wall_time_s"]  # before training starts, after it ends
hit = next((r for r in rows if (r.get("train_return_recent") or -99) >= 18), None)
last = rows[-1]
print(f"{run}: {summary['env_steps']} env steps in {summary['wall_time_s']:.0f} s of training "
      f"(process {end - start:.0f} s), training return {last.get('train_return_recent')}")
if hit:
    print(f"  +18 at {hit['env_steps']} env steps, {hit['wall_time_s'] + startup:.0f} s from the "
          f"command's start (at most; start-up and shutdown {startup:.0f} s counted)")
else:
    print("  +18 not reached")
PY
done
