#!/usr/bin/env bash
# The GPU measurements of privkit (issue 32), in one command on a machine with an NVIDIA GPU (the
# device machine of the development workplace, or your own). Writes JSON and logs into $OUT
# (default benchmarks/results/gpu); at most 8 files, so that a lent machine sends them all back
# (with `| tee $OUT/log.txt`: the log, and dpsgd_step, step_kernels, canary_overhead, profile_step,
# device_noise, pipeline_cpu and pipeline_cuda).
# Packages missing on that machine travel as wheels in .whl/: installed into /tmp/site when present.
#   DPSGD_REPEATS (15), CANARY_REPEATS (15), PIPELINE_METHODS (dp-fedavg,dpsgd),
#   ALL=1 also runs the earlier measurements (noise throughput, many models at once).
#   STAGES (step,kernels,canary,profile,noise,pipeline,trainprofile,waits,autocast,tests): the stages to run, so that a
#   lease too short for all of them can take them in two calls.
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi -L || true
python3 -c "import torch, opacus; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(), 'opacus', opacus.__version__)"
METHODS=${PIPELINE_METHODS:-dp-fedavg,dpsgd}
STAGES=,${STAGES:-step,kernels,canary,profile,noise,pipeline,trainprofile,waits,autocast,tests},
stage() { [[ $STAGES == *,$1,* ]]; }
DEV=${DEV:-cuda}  # DEV=cpu BIG= CANARY_MODELS=mlp: a dry run of this script on a machine without a GPU

if stage pipeline; then
echo "== the CPU side of privkit train/audit, two threads, in the background (cores 12-15)"
PIN=""; [ "$(nproc)" -ge 16 ] && PIN="taskset -c 12-15"
$PIN python3 benchmarks/pipeline_device.py --device cpu --threads 2 --methods "$METHODS" \
  --json > "$OUT/pipeline_cpu.json" 2>> /tmp/pipeline.log &
CPU_SIDE=$!

fi
if stage step; then
echo "== one DP-SGD step: privkit against opacus and SGD (torch's LSTM and LSTM cell, the 3-d CNN, the frozen-BatchNorm ResNet and the EmbeddingBag classifier among the models: 330 s)"
timeout 330 python3 benchmarks/dpsgd_step.py --device $DEV ${BIG---big} --repeats "${DPSGD_REPEATS:-15}" --json \
  > "$OUT/dpsgd_step_cuda.json"
python3 - "$OUT/dpsgd_step_cuda.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d["models"].items():
    print(name, r["privkit_path"], {v: round(t, 1) for v, t in r["median_ms"].items()},
          "vs sgd", {v: round(t, 2) for v, t in r["vs_sgd"].items()})
PY

fi
if stage kernels; then
echo "== operations one step dispatches on the device (the launch-bound regime's measure)"
timeout 120 python3 benchmarks/step_kernels.py --device $DEV ${BIG---big} --json > "$OUT/step_kernels_$DEV.json"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({n: r['operations'] for n, r in d['models'].items()})" "$OUT/step_kernels_$DEV.json"

fi
if stage canary; then
echo "== canaries on the device"
timeout 120 python3 benchmarks/canary_overhead.py --device $DEV --models ${CANARY_MODELS:-resnet_gn,mlp,resnet18} \
  --repeats "${CANARY_REPEATS:-15}" --json > "$OUT/canary_overhead_cuda.json"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['model'], r['noise'], r['canaries'], r['path'], round(r['median_ms'], 2), round(r['overhead'], 3)) for r in d['rows']]" "$OUT/canary_overhead_cuda.json"
echo "== canaries on the device, the clipped sum replayed (StepReplay)"
timeout 180 python3 benchmarks/canary_overhead.py --device $DEV --models ${CANARY_MODELS:-resnet_gn,mlp,resnet18} \
  --paths sparse --replay --opacus --repeats "${CANARY_REPEATS:-15}" --json > "$OUT/canary_overhead_cuda_replay.json"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['model'], r['noise'], r['canaries'], r['path'], round(r['median_ms'], 2), round(r['overhead'], 3)) for r in d['rows']]" "$OUT/canary_overhead_cuda_replay.json"

fi
if stage profile; then
echo "== where a ResNet-18 DP-SGD step spends its time (torch profiler)"
timeout 90 python3 - $DEV ${PROFILE_MODEL:-resnet18} > "$OUT/profile_step.txt" 2>&1 <<'PY'
import sys, torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from dpsgd_step import build, batch
from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.dp_sgd_step import DpSgdStep
dev = torch.device(sys.argv[1])
torch.backends.cudnn.benchmark = False
model, _, n = build(sys.argv[2]); model = model.to(dev)
x, y = batch(sys.argv[2], n, dev)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
step = DpSgdStep(1.0, 1.0, n / 50_000, 50_000)
src = DpRandom.secret(dev)
loss = lambda lo, t, aux: F.cross_entropy(lo, t)
for _ in range(3):
    step.apply(model, opt, x, y, loss, src)
dev.type == "cuda" and torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (dev.type == "cuda"), record_shapes=True) as prof:
    for _ in range(3):
        step.apply(model, opt, x, y, loss, src)
    dev.type == "cuda" and torch.cuda.synchronize()
ka = prof.key_averages()
key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
print(ka.table(sort_by=key, row_limit=30, max_name_column_width=60))
print(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
print(prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=25, max_name_column_width=50, max_shapes_column_width=70))
PY
head -45 "$OUT/profile_step.txt"

fi
if stage noise; then
echo "== release noise throughput on the device (10M normals)"
timeout 90 python3 benchmarks/device_noise_throughput.py --device $DEV --json > "$OUT/device_noise_$DEV.json"
cat "$OUT/device_noise_$DEV.json"

fi
if stage pipeline; then
echo "== privkit train/audit on $DEV"
timeout 330 python3 benchmarks/pipeline_device.py --device $DEV --methods "$METHODS" --json \
  > "$OUT/pipeline_cuda.json" 2>> /tmp/pipeline.log

fi
if stage trainprofile; then
echo "== where a quick dp-fedavg training on cuda spends its time (cProfile)"
timeout 90 python3 - $DEV > /tmp/profile_train.txt 2>&1 <<'PY'
import cProfile, pstats, sys
from privkit.cli import main
dev = sys.argv[1]
sys.argv = ["privkit", "train", "dp-fedavg", "--quick", "--set", "device=" + dev, "--out", "/tmp/prof-run", "--json"]
pr = cProfile.Profile()
pr.enable()
try:
    main()
except SystemExit:
    pass
pr.disable()
st = pstats.Stats(pr, stream=sys.stdout)
st.sort_stats("tottime").print_stats(40)
st.sort_stats("cumulative").print_stats(45)
PY
grep -m1 "function calls" /tmp/profile_train.txt
grep -A 30 "Ordered by: internal" /tmp/profile_train.txt | head -34

fi
if stage pipeline; then
echo "== waiting for the CPU side"
wait $CPU_SIDE
cat /tmp/pipeline.log

fi
if stage waits; then
echo "== where a DP-SGD step waits for the device (printed here: the files back are eight at most)"
timeout 150 python3 benchmarks/device_waits.py --device $DEV --models resnet_small,transformer \
  --train dp-fedavg,dpsgd --json

fi
if stage autocast; then
echo "== one DP-SGD step under bfloat16 autocast (printed here: the files back are eight at most)"
timeout 200 python3 benchmarks/dpsgd_step.py --device $DEV --autocast --models ${AUTOCAST_MODELS:-resnet18,transformer,lm} \
  --repeats 10 --json | python3 -c "import json,sys; d=json.load(sys.stdin); [print(n, {v: round(t, 1) for v, t in r['median_ms'].items()}, 'vs sgd', {v: round(t, 2) for v, t in r['vs_sgd'].items()}, r['unavailable']) for n, r in d['models'].items()]"

fi
if stage tests; then
echo "== tests on cuda"
PRIVKIT_TEST_DEVICE=$DEV timeout 100 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
  tests/privkit/test_device_random.py tests/privkit/test_on_device.py 2>&1 | tail -6

fi
if [ "${ALL:-0}" = 1 ]; then
  echo "== noise throughput"
  timeout 200 python3 benchmarks/device_noise_throughput.py --device cuda --compile --json > "$OUT/device_noise_cuda_compiled.json"
  for m in 64 16; do
    echo "== shadow training, $m models, loop and batched on cuda"
    timeout 400 python3 benchmarks/shadow_training.py --device cuda --models $m --repeats 3 --no-peers --json \
      > "$OUT/shadow_training_cuda_$m.json"
  done
fi
echo "== done"
