# Sourced (from the repo root) by the ops/device check scripts: the wheels the device image
# lacks (carry .gpuwheels/), import paths, an output folder, and a header saying what ran where.
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpuwheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format='commit %H' 2>/dev/null || true
