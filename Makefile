# ckptio: every target installs what it needs on a fresh Debian machine,
# configures meson on first use, builds, and runs.
#
#   make demo    the main job (DEMO_ARGS="..." to pass flags)
#   make test    the whole suite: normal build, ASan/UBSan build, ThreadSanitizer build of the
#                runtime/HTTP/pipeline tests, Python tests; ends with "N passed, N failed"
#   make test-tsan  only the ThreadSanitizer part
#   make bench   the benchmarks; tables go to bench/results/
#   make build   just build (build/)

SHELL := /bin/bash
BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
# The tests with threads worth racing: the loop, the CPU pool, HTTP, the manager.
TSAN_TESTS := runtime_task runtime_loop http_client pipeline_manager pipeline_crash pipeline_disk_full \
  pipeline_preemption
TSAN_TARGETS := $(addprefix tests/,$(addsuffix _test,$(TSAN_TESTS))) tests/pipeline/crash_saver \
  tests/pipeline/preempt_trainer
DEMO_ARGS ?=

APT_PACKAGES := g++ make meson ninja-build pkg-config cmake python3 python3-venv \
  liburing-dev libcurl4-openssl-dev libssl-dev nlohmann-json3-dev doctest-dev libisal-dev \
  fio openmpi-bin libopenmpi-dev
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: all deps build build-asan build-tsan demo test test-tsan bench clean venv

all: build

deps:
	@.ci/ensure-deps.sh $(APT_PACKAGES)

$(BUILD)/build.ninja:
	meson setup $(BUILD) --buildtype=debugoptimized

# -O0 so the tests also cover the debug build (stack depth of synchronous
# completions), with AddressSanitizer and UndefinedBehaviorSanitizer.
$(ASAN_BUILD)/build.ninja:
	meson setup $(ASAN_BUILD) --buildtype=debug -Db_sanitize=address,undefined -Db_lundef=false \
	  -Dcpp_args=-fno-sanitize-recover=undefined

$(TSAN_BUILD)/build.ninja:
	meson setup $(TSAN_BUILD) --buildtype=debugoptimized -Db_sanitize=thread -Db_lundef=false

# Python packages for the integration tests (numpy, safetensors, ...), from PyPI.
$(VENV)/.installed: tests/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
	touch $@

venv: deps $(VENV)/.installed

build: deps $(BUILD)/build.ninja
	ninja -C $(BUILD)

build-asan: deps $(ASAN_BUILD)/build.ninja
	ninja -C $(ASAN_BUILD)

build-tsan: deps $(TSAN_BUILD)/build.ninja
	ninja -C $(TSAN_BUILD) $(TSAN_TARGETS)

demo: build
	$(BUILD)/src/cli/ckptio demo $(DEMO_ARGS)

test: build build-asan build-tsan venv
	@rc=0; \
	meson test -C $(BUILD) --print-errorlogs --num-processes 2 || rc=1; \
	meson test -C $(ASAN_BUILD) --print-errorlogs --num-processes 2 || rc=1; \
	meson test -C $(TSAN_BUILD) --no-rebuild --print-errorlogs --num-processes 2 $(TSAN_TESTS) || rc=1; \
	CKPTIO_BIN=$(BUILD)/src/cli/ckptio $(PYTHON) -m pytest -q tests/integration tests/gcs \
	  --junitxml=$(BUILD)/pytest.xml -p no:cacheprovider || rc=1; \
	python3 tests/tools/summarize.py $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) --junit $(BUILD)/pytest.xml || rc=1; \
	exit $$rc

test-tsan: build-tsan
	@rc=0; \
	meson test -C $(TSAN_BUILD) --no-rebuild --print-errorlogs --num-processes 2 $(TSAN_TESTS) || rc=1; \
	python3 tests/tools/summarize.py $(TSAN_BUILD) || rc=1; \
	exit $$rc

bench: build
	@mkdir -p bench/results
	$(BUILD)/bench/runtime_bench | tee bench/results/runtime.md
	$(BUILD)/bench/checkpoint_bench | tee bench/results/checkpoint.md
	@rm -rf bench/results/tmp

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(VENV)
