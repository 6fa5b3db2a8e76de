# Two commands do all set-up on a fresh machine:
#   make demo   - the main job on an embedded default (local Kafka, generated demo model)
#   make test   - the whole test suite (CPU only)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The suite runs in one pytest process per core, up to 4 (pytest-xdist): the tests hold torch to
# one intra-op thread; on CI's 2 vCPUs two workers ran it ~1.4x faster than one (RESULTS, s35).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$((n < 4 ? n : 4)))
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install kafka-jars test test-fast demo lint schemas cutlass clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	bash ops/install_venv.sh $(PY)
	touch $(STAMP)

install: $(STAMP)

kafka-jars:
	bash ops/kafka/kafka.sh fetch

lint: install
	$(VENV)/bin/ruff check engine schemas prism_pipeline ops tests

schemas: install
	$(PY) -m schemas.export

# Optional, for Hopper GPUs: the CUTLASS int8 GEMM library (engine/kernels/cutlass_gemm.py), built
# with NVIDIA's nvcc wheels (unpacked into .cache/cutlass-toolchain/, apart from the venv) into
# .cache/cutlass/; int8_gemm uses it where it is built. No GPU needed.
cutlass: install
	$(PY) ops/build_cutlass.py --toolchain

test: install kafka-jars
	$(VENV)/bin/ruff check engine schemas prism_pipeline ops tests
	@df -h . "$${TMPDIR:-/tmp}" | sed 's/^/disk before the tests: /'
	$(PY) -m pytest $(XDIST)

test-fast: install kafka-jars
	$(PY) -m pytest $(XDIST) -m "not slow"

demo: install kafka-jars
	$(PY) -m prism_pipeline.cli demo $(ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
