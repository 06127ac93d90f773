#!/usr/bin/env bash
# The GPU measurements of privkit, in one command on a machine with an NVIDIA GPU (the device
# machine of the development workplace, or your own). Writes JSON into $OUT (default
# benchmarks/results/gpu). Packages missing on that machine travel as wheels in .whl/ (see
# benchmarks/README or the session notes): they are installed into /tmp/site first when present.
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
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
echo "== tests on cuda"
PRIVKIT_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/privkit/test_device_random.py tests/privkit/test_on_device.py 2>&1 | tail -4
echo "== noise throughput"
timeout 200 python3 benchmarks/device_noise_throughput.py --device cuda --compile --json > "$OUT/device_noise_cuda.json"
cat "$OUT/device_noise_cuda.json"
for m in 64 16; do
  echo "== shadow training, $m models, loop and batched on cuda"
  timeout 400 python3 benchmarks/shadow_training.py --device cuda --models $m --repeats 3 --no-peers --json \
    > "$OUT/shadow_training_cuda_$m.json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: round(d[k]['speedup'],2) for k in ('dpsgd','sgd')}, {k: round(d['cnn'][k]['speedup'],2) for k in ('dpsgd','sgd')})" "$OUT/shadow_training_cuda_$m.json"
done
echo "== one quick training per method, cuda against this machine's CPU (one thread)"
python3 - "$OUT/train_quick_cuda_cpu.json" <<'PY'
import json, subprocess, sys, time
rows = []
for method in ("dpsgd", "dp-fedavg", "fedkadp", "fedavg"):
    for dev in ("cuda", "cpu"):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", "from privkit.cli import main; main()", "train", method,
                            "--quick", "--set", f"device={dev}", "--out", f"/tmp/run-{method}-{dev}", "--json"],
                           capture_output=True, text=True, timeout=300)
        rows.append({"method": method, "device": dev, "rc": r.returncode, "wall_s": time.perf_counter() - t,
                     "stderr_tail": r.stderr[-300:] if r.returncode else ""})
        print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
PY
