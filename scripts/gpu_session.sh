#!/usr/bin/env bash
# One device call for issue 53's GPU targets, prepared and tested on the CPU (with DRY=1: tiny
# budgets, the CPU). Run from the repository root on the GPU machine, carrying .whl:
#
#     bash scripts/gpu_session.sh            # <= 570 s: breakdown, batch_update, 2 seeds, splits
#     LEVERS=1 bash scripts/gpu_session.sh   # ~500 s: seed 1 under each sample-efficiency lever
#     BREAKOUT=1 bash scripts/gpu_session.sh # ~540 s: the `atari` preset's Breakout, resumable
#     THROUGHPUT=1 bash scripts/gpu_session.sh  # <= 570 s: gpu_box.py, levers, MPS, 2 seeds of the best
#
# 0. tests/test_update_graph.py on the GPU: the captured update (its optimizer step in the
#    graph) against the eager one;
# 1. benchmarks/step_breakdown.py and batch_update.py for pong_appo at B=4, with the weights
#    published after every step and once per batch (algorithm.broadcast_every=null; then also
#    the breakdown with the optimizer step outside the graph, as before), and batch_update.py
#    for the sized update (the 4 unrolls in 16 minibatches: 48 steps a batch);
# 2. `impala train pong_appo seed=S` with no other override but the budget, seeds 1 and 2:
#    the whole process's wall time to the first epoch with a training return >= 18 (start-up
#    included), printed per seed, and the ReLU units its network has left alive
#    (benchmarks/dead_units.py). Everything it prints and the runs' metrics go to $OUT.
# With LEVERS=1, instead: seed 1 under each lever, printing when it passes -15, 0, +15 and +18.
# The sizing cuts the sized batch (4 unrolls of 8 envs) into 16 minibatches, the preset's
# optimizer steps per env step; the 4 minibatches it took before needed 2.56M env steps to +18
# (run 35); it publishes the weights every 4th step (12 publishes a batch, as the preset's). The
# levers: the old 4 minibatches (the comparison), each actor's envs in one group instead of the
# sizing's two taking turns (runner.env_splits=1; on 2 CPU cores two groups filled batches
# 1.07-1.46x faster, benchmarks/env_splits.py), and the weights published after every step (as
# often per env step as on 2 cores, 48 publishes a batch at ~0.9 ms each; on 2 cores run 38
# found the 4th-step publishes within the seeds' spread up to +15).
# 140 s of training each, to fit one device call.
# With THROUGHPUT=1, instead: benchmarks/gpu_box.py for the sized `pong_appo` (no override: its
# ratio to the env bound, target 0.8) and, in the same call, the levers on env steps/s, which
# bound the time to +18 (~19k needed for 90 s). Run 51 found the sized run learner-bound (the
# learner 78-97% of an update, twice the update's time alone, 16 actors and 2 servers beside
# it on 16 cores; a third server slower). Run 52 found the GPU shared between processes the
# bound, not the cores: 12 actors no faster, one inference server +14% (its ~800 small batches
# a second time-slice the GPU with the learner's replays), the weights published once a pass
# (every 16th step: 3 publishes a batch instead of 12; servers loading weights 16% -> 4%) +18%.
# So the levers are the two together, and the server as a thread of the learner's process
# (runner.inference=learner: one CUDA context, the weights copied on the device at each
# broadcast instead of through shared memory), publishing every 4th step and once a pass; 40 s
# each.
# Then, if one lever stepped >= 5% faster, seeds 1 and 2 under it for ~95 s each, with the same
# report as the default call's (seconds from the command's start to -15, 0, +15, +18).
# With BREAKOUT=1, instead: `benchmarks/learning.py atari --seeds 1` (Breakout, 10M env steps,
# sized to the box) for 480 s in runs/gpu-breakout, continued from its checkpoint by the next
# call; its curve per million env steps. Runs/ stays on a warm machine between calls; the run
# also comes back under $OUT/gpu-breakout: put it in runs/ and carry it to a cold one.
set -u
export PYTHONUNBUFFERED=1
START_S=$SECONDS
# The device call's limit is 600 s: the training runs get what the earlier parts left of
# BUDGET_S (a run's start-up and shutdown, ~40 s, kept aside), at most WALL each.
BUDGET_S="${BUDGET_S:-570}"
OUT="${OUT:-/tmp/gpu-session}"
mkdir -p "$OUT"
if [ "${DRY:-0}" = 1 ]; then
    DEVICE=cpu; WALL=20; BATCHES=1; SIZED_M=4; B="algorithm.actors_batch_size=1 algorithm.envs_per_actor=4"
    IMPALA_PYTHON="${IMPALA_PYTHON:-.venv/bin/python}"
else
    source scripts/device_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
    DEVICE=cuda; WALL=150; BATCHES=10; SIZED_M=16; B="algorithm.actors_batch_size=4 algorithm.envs_per_actor=8"
    nvidia-smi --query-gpu=name --format=csv,noheader
fi
PY="${IMPALA_PYTHON:-python3}"
report() {  # report RUN START END: env steps and seconds from the command's start to each return
    "$PY" - "$@" <<'PY'
import json, sys
run, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
summary = json.load(open(f"{run}/summary.json"))
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
startup = (end - start) - summary["wall_time_s"]  # before training starts, after it ends
print(f"{run}: {summary['env_steps']} env steps in {summary['wall_time_s']:.0f} s of training "
      f"(process {end - start:.0f} s), training return {rows[-1].get('train_return_recent')}")
for level in (-15, 0, 15, 18):
    hit = next((r for r in rows if (r.get("train_return_recent") or -99) >= level), None)
    at = "not reached" if hit is None else (
        f"at {hit['env_steps']} env steps, {hit['wall_time_s'] + startup:.0f} s from the "
        f"command's start (start-up and shutdown {startup:.0f} s counted)")
    print(f"  {level:+d} {at}")
PY
}
train() {  # train NAME SEED OVERRIDES...: one budgeted run of pong_appo, then its report
    local run="$OUT/$1" seed=$2
    shift 2
    local start end wall=$((BUDGET_S - (SECONDS - START_S) - 40))
    [ $wall -gt $WALL ] && wall=$WALL
    if [ $wall -lt 30 ] && [ $wall -lt $WALL ]; then
        echo "$run: not run, $((SECONDS - START_S)) s of the ${BUDGET_S}-s budget gone"
        return 1
    fi
    [ $wall -lt $WALL ] && echo "$run: ${wall} s of training (the budget's rest), not $WALL"
    start=$(date +%s.%N)
    timeout $((wall + 90)) "$PY" -m impala_rl.cli train pong_appo seed=$seed target_return=null \
        max_wall_time_s=$wall log.console=false "$@" --run-dir "$run" > "$run.log" 2>&1
    end=$(date +%s.%N)
    report "$run" "$start" "$end"
}
if [ "${BREAKOUT:-0}" = 1 ]; then
    # benchmarks/learning.py continues the run from its checkpoint when started again; each
    # call gives it WALL s, then timeout's SIGTERM stops the trainer with a checkpoint.
    bench=runs/gpu-breakout small=()
    if [ "${DRY:-0}" = 1 ]; then
        bench="$OUT/gpu-breakout"
        small=(algorithm.n_rollout_steps=16 algorithm.epoch_length=1 algorithm.actors_batch_size=2
            algorithm.rollout_evaluator.n_episodes=1 algorithm.rollout_evaluator.max_episode_steps=300)
    else
        WALL=480
    fi
    timeout -k 60 $WALL "$PY" benchmarks/learning.py atari "${small[@]}" --steps 10000000 \
        --seeds 1 --thresholds 10 50 100 200 --out "$bench" > "$OUT/breakout.log" 2>&1
    "$PY" - "$bench/seed1/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for i, r in enumerate(rows):  # the first row past each million env steps, and the last
    if i == len(rows) - 1 or r["env_steps"] // 10**6 > rows[i - 1]["env_steps"] // 10**6:
        print(f"{r['env_steps']:>9} env steps, {r['wall_time_s']:.0f} s: training return "
              f"{r.get('train_return_recent')}, evaluation {r.get('eval_return/mean')}")
PY
    [ "${DRY:-0}" = 1 ] || cp -r "$bench" "$OUT/"  # to carry to a cold machine's runs/
    exit 0
fi
if [ "${THROUGHPUT:-0}" = 1 ]; then
    sized='algorithm.actors_batch_size=4 algorithm.num_minibatches=16 algorithm.broadcast_every=4'
    secs=40 env_s=8 procs=() vs=(--vs 'runner.inference_servers=1 algorithm.broadcast_every=16'
        --vs 'runner.inference=learner' --vs 'runner.inference=learner algorithm.broadcast_every=16')
    if [ "${DRY:-0}" = 1 ]; then
        secs=15 env_s=3 procs=(--procs 2) vs=(--vs 'algorithm.num_actors=1' --vs 'runner.inference=learner')
    fi
    timeout $((BUDGET_S - (SECONDS - START_S) - 10)) "$PY" benchmarks/gpu_box.py "${procs[@]}" \
        --env-seconds $env_s --train-seconds $secs --out "$OUT/gpu_box.json" pong_appo "${vs[@]}" \
        2>&1 | grep -v "A.L.E\|Stella"
    # then the sizing and the first lever again under CUDA's Multi-Process Service, where the
    # box has it: the learner's and the servers' kernels run on the GPU side by side instead of
    # their processes' contexts taking turns (no code change; every CUDA process started after
    # the daemon, with its pipe directory in the environment, is its client)
    outs=("$OUT/gpu_box.json")
    mps=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control \
        2> /dev/null)
    if [ -n "$mps" ] && [ "${DRY:-0}" != 1 ]; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if "$mps" -d; then
            trap 'echo quit | "$mps"' EXIT
            timeout $((BUDGET_S - (SECONDS - START_S) - 10)) "$PY" benchmarks/gpu_box.py \
                --env-seconds 4 --train-seconds $secs --out "$OUT/gpu_box_mps.json" pong_appo \
                --vs 'runner.inference_servers=1 algorithm.broadcast_every=16' 2>&1 |
                grep -v "A.L.E\|Stella"
            echo "MPS servers: $(echo get_server_list | "$mps")"
            tail -3 "$CUDA_MPS_LOG_DIRECTORY/control.log"
            outs+=("$OUT/gpu_box_mps.json")
        else
            echo "MPS: the daemon did not start"
        fi
    else
        echo "MPS: nvidia-cuda-mps-control is not on this machine"
    fi
    # then, in the budget's rest, seeds 1 and 2 to +18 under the fastest lever (MPS one too),
    # if one stepped >= 5% faster than the sizing (DRY: always, to test the path): ~95 s each
    pick=$("$PY" - "${DRY:-0}" "${outs[@]}" <<'PY'
import json, sys
runs = [(json.load(open(path)), path.endswith("_mps.json")) for path in sys.argv[2:]]
base = runs[0][0]["training_env_steps_per_s"] or 0
found = [(v["training_env_steps_per_s"] or 0, mps, v["vs"]) for r, mps in runs for v in r["variants"]]
found += [(r["training_env_steps_per_s"] or 0, mps, "") for r, mps in runs if mps]
rate, mps, vs = max(found, key=lambda f: f[0], default=(0, False, ""))
if found and (rate >= 1.05 * base or sys.argv[1] == "1"):
    print("mps" if mps else "plain", vs)
PY
)
    if [ -n "$pick" ]; then
        where=${pick%% *} best=${pick#* }
        if [ "$where" != mps ] && [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
            echo quit | "$mps"
            trap - EXIT
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        fi
        echo "seeds 1 and 2 under the fastest lever ($where): ${best:-the sizing}"
        [ "${DRY:-0}" = 1 ] || WALL=95
        # shellcheck disable=SC2086  # the lever's overrides, one word each
        for seed in 1 2; do train pong_appo-lever-seed$seed $seed algorithm.epoch_length=25 $best; done
    else
        echo "no lever stepped >= 5% faster than the sizing: no seeds trained"
    fi
    exit 0
fi
if [ "${LEVERS:-0}" = 1 ]; then
    [ "${DRY:-0}" = 1 ] || WALL=140
    train pong_appo-m4-seed1 1 algorithm.num_minibatches=4  # the sizing before: 8 columns a step
    train pong_appo-splits1-seed1 1 runner.env_splits=1  # each actor's 8 envs as one group
    train pong_appo-every1-seed1 1 algorithm.broadcast_every=1
    exit 0
fi
# 0. the captured update, its optimizer step in the graph, against the eager one on this GPU
if "$PY" -c "import pytest" 2> /dev/null; then
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_update_graph.py 2>&1 | tail -4
else
    echo "pytest is not on this machine (carry its wheels): tests/test_update_graph.py not run"
fi
for every in 1 null; do
    timeout 120 "$PY" benchmarks/step_breakdown.py pong_appo algorithm.device=$DEVICE $B \
        algorithm.broadcast_every=$every --batches $BATCHES 2>&1 | tail -9
    # the comparison (publishing once a batch): the host steps after the graph, as before
    [ $every = null ] && timeout 120 "$PY" benchmarks/step_breakdown.py pong_appo \
        algorithm.device=$DEVICE $B algorithm.broadcast_every=$every --batches $BATCHES \
        --step-outside-graph 2>&1 | tail -9
    timeout 120 "$PY" benchmarks/batch_update.py pong_appo algorithm.device=$DEVICE $B \
        algorithm.broadcast_every=$every --repeats $BATCHES 2>&1 | tail -1
    # the sized update: 4 minibatches per unroll (on the GPU 16 of the 4 unrolls, run 37)
    timeout 120 "$PY" benchmarks/batch_update.py pong_appo algorithm.device=$DEVICE $B \
        algorithm.num_minibatches=$SIZED_M algorithm.broadcast_every=$every \
        --repeats $BATCHES 2>&1 | tail -1
done
for seed in 1 2; do
    # and how many of the torso's ReLU units the sized run left alive (a few seconds)
    train pong_appo-seed$seed $seed &&
        timeout 120 "$PY" benchmarks/dead_units.py "$OUT/pong_appo-seed$seed" 2>&1 | tail -2
done
# 3. if the budget leaves time: the actors and servers alone, the sizing's two env groups against
#    one (benchmarks/env_splits.py, one pair, fresh processes each)
if [ $((BUDGET_S - (SECONDS - START_S))) -ge 70 ]; then
    sized=(algorithm.device=$DEVICE algorithm.num_actors=16 algorithm.actors_batch_size=4
        env.kwargs.vector_threads=1 runner.inference_servers=2)
    [ "${DRY:-0}" = 1 ] && sized=(algorithm.num_actors=2 algorithm.actors_batch_size=2
        env.kwargs.vector_threads=1 algorithm.envs_per_actor=4)
    timeout 120 "$PY" benchmarks/env_splits.py pong_appo "${sized[@]}" --seconds 8 --pairs 1 \
        2>&1 | grep -v "A.L.E\|Stella" | tail -4
else
    echo "benchmarks/env_splits.py: not run, $((SECONDS - START_S)) s of the budget gone"
fi
