#!/usr/bin/env bash
# The checks of fisherkron that need a GPU, in one short run (about 4 minutes on one H100):
#   1. the suite's CUDA tests (tests/test_core_operators.py -k cuda);
#   2. the NCCL path: scripts/nccl_check.py under torchrun, one process per GPU; the Hugging Face
#      pipeline (calibration, every method's compression) on the GPU against the CPU:
#      scripts/cuda_pipeline_check.py;
#   3. the README's GPU target: MFF of an 11008 x 4096 layer with 75 gradients (the
#      Llama-2-7B MLP shape; also its 4096 x 11008 down and 4096 x 4096 attention shapes) on the
#      GPU, gradients there, timings synchronised (scripts/bench_mff.py --device cuda; the
#      authors' approach, on the host, is skipped).
# Usage: scripts/gpu_check.sh [OUTDIR]   (default build/gpu-check): machine.txt, one log per step and
# bench.tgz, the benchmark's tables and figure (bench/; committed under figures/bench/gpu/, whose
# README row "GPU: 11008x4096 with 75 gradients" renders from them: `make readme`).
# Runs with the python3 on PATH and this checkout on PYTHONPATH (no install needed where torch,
# scipy, pandas and matplotlib are present). Each step has its own time limit; the script goes on
# after a failed step and exits non-zero if any failed.
set -u
out=${1:-build/gpu-check}
mkdir -p "$out/bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output to $out/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version())"
  nproc
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
step pytest_cuda 90 python3 -m pytest -q -p no:cacheprovider tests/test_core_operators.py -k cuda -rs
step nccl 120 python3 -m torch.distributed.run --standalone --nproc_per_node="${gpus:-1}" scripts/nccl_check.py
step cuda_pipeline 120 python3 scripts/cuda_pipeline_check.py  # also committed as figures/bench/gpu/*.log
step bench 360 python3 scripts/bench_mff.py --device cuda --sizes 11008x4096x75 4096x11008x75 4096x4096x75 --minilm-layer none \
  --no-whole-model --out "$out/bench"
tar -czf "$out/bench.tgz" -C "$out" bench && rm -r "$out/bench"
exit $status
