#!/usr/bin/env bash
# docs/benchmarks.md's GPU measurements, cut to fit a lent GPU session (15 minutes of device time,
# 10 a call; /work/.library/device/README.md in the workplace that lends them). Run on the device
# machine from the repository root, one part a call, `.whl` carried:
#   bash benchmarks/gpu_session.sh float8   # float8 against bf16, 300 compiled steps each (~6 min, H200)
#   bash benchmarks/gpu_session.sh eager    # the 1.1B table's eager variants (plain, AC), profiled (~4 min)
#   bash benchmarks/gpu_session.sh compiled # its compiled variants (compile, compile+AC), profiled (~5 min)
#   bash benchmarks/gpu_session.sh checks   # offload, async resume, generation under FULL_SHARD, profiling
# `.whl` (ignored by .gitignore: name it in the device call's carry) holds the wheels the device image lacks, for its Python 3.12,
# made here once:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_28_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1 peft==0.21.2 torchao==0.18.0
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # published as a source archive only
# The raw results come back in $OUT; render them here with
#   python benchmarks/run.py --only float8 --from-json <files>/float8.json
#   python benchmarks/run.py --only gpu --from-json <files>/eager.json <files>/compiled.json <files>/checks.json
# (each JSON is rewritten after every variant, float8's every 10 steps of each run and the checks' after
# each check: a call that runs out of time brings back what it measured, dated)
set -euo pipefail
: "${OUT:?OUT: the folder whose files come back (the device tool sets it)}"
part="${1:-}"
case "$part" in
    float8 | eager | compiled | checks) ;;
    *) echo "usage: bash benchmarks/gpu_session.sh float8|eager|compiled|checks" >&2; exit 2 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt"
case "$part" in
    float8) python3 benchmarks/run.py --only float8 --train-steps 300 --json-out "$OUT/float8.json" ;;
    eager) python3 benchmarks/run.py --only gpu --gpu-variants plain ac --no-checks --json-out "$OUT/eager.json" ;;
    compiled)
        python3 benchmarks/run.py --only gpu --gpu-variants compile compile+ac --no-checks \
            --json-out "$OUT/compiled.json" ;;
    checks)  # the worker writes {"runs": [], "checks": {...}} (run.py --from-json's) after each check
        python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/gpu_worker.py checks \
            --partial "$OUT/checks.json" | tee "$OUT/checks.out" ;;
esac 2>&1 | tee "$OUT/log.txt"
