# ckptio: every target installs what it needs on a fresh Debian machine,
# configures meson on first use, builds, and runs.
#
#   make demo    the main job (DEMO_ARGS="..." to pass flags)
#   make test    the whole suite: the integration and Python tests on the normal build, every
#                doctest program on the ASan/UBSan build, the threaded ones on a ThreadSanitizer
#                build, the fuzz targets' regression cases and a FUZZ_TEST_SECONDS (30 s) fuzz
#                run of each; ends with "N passed, N failed"
#   make fuzz    the long fuzz run: each target for FUZZ_SECONDS (3600), in parallel
#                (tests/fuzz/README.md)
#   make test-tsan  only the ThreadSanitizer part
#   make bench   the benchmarks; tables go to bench/results/
#   make build   just build (build/)
#   make wheel   the wheel for PyPI (manylinux_2_31, cp311) and the sdist, in build-wheel/
#   make test-wheel  the wheel and the sdist installed into a Debian root without the build's
#                packages (tests/wheel); not part of make test, .ci/run runs it

SHELL := /bin/bash
BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
# The libFuzzer targets: a meson project of their own, built with clang.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 3600
FUZZ_TEST_SECONDS ?= 30
# The tests with threads worth racing: the loop, the CPU pool, HTTP, the manager, pods (managers of several
# hosts in one process: swaps, copies, reads across loops), GCS on several loops,
# gathered O_DIRECT writes (copies on the CPU pool), recycling (prunes on the CPU pool).
TSAN_TESTS := runtime_task runtime_loop http_client pipeline_manager pipeline_crash pipeline_disk_full pipeline_pods \
  pipeline_preemption gcs_loops storage_direct_write storage_recycle
TSAN_TARGETS := $(addprefix tests/,$(addsuffix _test,$(filter-out gcs_loops,$(TSAN_TESTS)))) \
  tests/pipeline/crash_saver tests/pipeline/preempt_trainer tests/gcs/gcs_checkpoint_test
DEMO_ARGS ?=

APT_PACKAGES := g++ make meson ninja-build pkg-config cmake python3 python3-venv \
  liburing-dev libcurl4-openssl-dev libssl-dev nlohmann-json3-dev doctest-dev libisal-dev libxxhash-dev \
  fio openmpi-bin libopenmpi-dev clang libclang-rt-14-dev
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: all deps build build-asan build-tsan build-fuzz demo test test-tsan fuzz bench clean venv venv-bench \
  wheel wheel-root test-wheel

all: build

deps:
	@.ci/ensure-deps.sh $(APT_PACKAGES)

# The build is always configured with the venv's Python, so the Python module (build/python) is
# built whichever of demo, build or test ran first. A build dir configured otherwise (by an
# older checkout) is reconfigured once: the stamp records the interpreter it was given.
# -O2 with line tables only (-g1): backtraces and perf keep file and line; full debug info
# (-g) made this build 30% slower to compile. `meson configure build -Dcpp_args=` for -g.
# Without the doctest programs (-Dunit_tests=false): they run in the ASan/UBSan build (and
# the threaded ones under TSan); build/ runs the integration tests and the Python tests.
$(BUILD)/build.ninja: | $(VENV)/.build-installed
	meson setup $(BUILD) --buildtype=debugoptimized -Dcpp_args=-g1 -Dunit_tests=false \
	  -Dpython_interpreter=$(CURDIR)/$(PYTHON)

$(BUILD)/.python-configured: $(VENV)/.build-installed | $(BUILD)/build.ninja
	meson configure $(BUILD) -Dpython_interpreter=$(CURDIR)/$(PYTHON)
	touch $@

# The sanitizer builds are unity builds (each library one translation unit): they compile
# nlohmann/json, liburing and the standard headers once per library instead of once per file.
# Measured on 2 cores (ninja -j2, no ccache): the ASan build 256 s -> 179 s. gcc then warns
# that a coroutine frame in one .cc uses another's anonymous namespace (-Wsubobject-linkage,
# meaningless inside one translation unit); the normal build stays one file per unit.
UNITY := -Dunity=on -Dunity_size=100
# AddressSanitizer and UndefinedBehaviorSanitizer at -O0 with line tables only (-g1): at -O1 -g
# the build took twice as long for a run half as long. The test of a million synchronous
# completions (stack depth at -O0) is built at -O0 in every build (tests/runtime/meson.build).
# No benchmarks here.
$(ASAN_BUILD)/build.ninja:
	meson setup $(ASAN_BUILD) --buildtype=debug -Doptimization=0 -Db_sanitize=address,undefined \
	  -Db_lundef=false -Dcpp_args='-fno-sanitize-recover=undefined -g1 -Wno-subobject-linkage' \
	  -Dbench=disabled $(UNITY)

# ThreadSanitizer at -O1 with line tables (-g1), what its documentation recommends for speed.
$(TSAN_BUILD)/build.ninja:
	meson setup $(TSAN_BUILD) --buildtype=debug -Doptimization=1 -Dcpp_args='-g1 -Wno-subobject-linkage' \
	  -Db_sanitize=thread -Db_lundef=false -Dbench=disabled $(UNITY)

$(FUZZ_BUILD)/build.ninja:
	CXX=clang++ meson setup $(FUZZ_BUILD) tests/fuzz $(UNITY)

# The venv: first what building and importing the Python module needs (pybind11, numpy,
# ml_dtypes: python/requirements.txt), for every build; then, for the tests, the packages
# of tests/requirements.txt (the GCS emulator, jax, ...). From PyPI.
$(VENV)/.build-installed: python/requirements.txt | deps
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r python/requirements.txt
	touch $@

$(VENV)/.installed: tests/requirements.txt $(VENV)/.build-installed
	$(VENV)/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
	touch $@

# PyTorch for ckptio.torch's tests and bench/torch_bench.py: torch and only the CUDA libraries its
# shared objects link, without their dependency tree (tests/requirements-torch.txt says why).
# Measured on this 2-core VM: 2.42 GB from PyPI (70 s at 33 MB/s), 1m17-1m51 s to install,
# 3.9 GB in the venv.
$(VENV)/.torch-installed: tests/requirements-torch.txt $(VENV)/.installed
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -r tests/requirements-torch.txt
	touch $@

venv: deps $(VENV)/.installed $(VENV)/.torch-installed

build: deps $(BUILD)/build.ninja $(BUILD)/.python-configured
	ninja -C $(BUILD)

build-asan: deps $(ASAN_BUILD)/build.ninja
	ninja -C $(ASAN_BUILD)

build-tsan: deps $(TSAN_BUILD)/build.ninja
	ninja -C $(TSAN_BUILD) $(TSAN_TARGETS)

build-fuzz: deps $(FUZZ_BUILD)/build.ninja
	ninja -C $(FUZZ_BUILD)

demo: build
	$(BUILD)/src/cli/ckptio demo $(DEMO_ARGS)

# The sanitizer and fuzz builds compile in the background, at a lower priority (nice), from the
# start: while pip fetches the test packages (network), build/ compiles (at normal priority),
# and build/'s tests and the Python tests run (those wait on processes, disks and sockets more
# than they compute), the compilers take the CPU the rest leaves. Then the sanitizer tests, with
# the fuzz run beside them (it runs for FUZZ_TEST_SECONDS whatever the load; its log follows).
test: deps $(ASAN_BUILD)/build.ninja $(TSAN_BUILD)/build.ninja $(FUZZ_BUILD)/build.ninja
	@rc=0; \
	step() { local name=$$1 t=$$SECONDS; shift; "$$@" || rc=1; \
	  echo "make test: $$name took $$((SECONDS - t)) s" >&2; }; \
	log=$(ASAN_BUILD)/sanitizer-builds.log; \
	echo "make test: building $(ASAN_BUILD), $(TSAN_BUILD) and $(FUZZ_BUILD) in the background (log: $$log)" >&2; \
	nice -n 10 $(MAKE) --no-print-directory build-asan build-tsan build-fuzz > $$log 2>&1 & bg=$$!; t0=$$SECONDS; \
	if ! $(MAKE) --no-print-directory venv build; then wait $$bg; exit 1; fi; \
	echo "make test: the venv and $(BUILD) were ready $$((SECONDS - t0)) s after the start" >&2; \
	step "$(BUILD) tests" meson test -C $(BUILD) --print-errorlogs --num-processes 2; \
	step "python tests" env CKPTIO_BIN=$(BUILD)/src/cli/ckptio $(PYTHON) -m pytest -q tests/integration \
	  tests/gcs tests/python --junitxml=$(BUILD)/pytest.xml -p no:cacheprovider; \
	if ! wait $$bg; then rc=1; echo "make test: a sanitizer or fuzz build failed:" >&2; tail -n 60 $$log >&2; fi; \
	echo "make test: the background builds were done $$((SECONDS - t0)) s after they started" >&2; \
	tests/fuzz/run.sh --build $(FUZZ_BUILD) --seconds $(FUZZ_TEST_SECONDS) --junit $(FUZZ_BUILD)/fuzz.xml \
	  > $(FUZZ_BUILD)/fuzz.log 2>&1 & fuzz=$$!; \
	step "$(ASAN_BUILD) tests" meson test -C $(ASAN_BUILD) --print-errorlogs --num-processes 2; \
	step "$(TSAN_BUILD) tests" meson test -C $(TSAN_BUILD) --no-rebuild --print-errorlogs --num-processes 2 \
	  $(TSAN_TESTS); \
	if ! wait $$fuzz; then rc=1; fi; cat $(FUZZ_BUILD)/fuzz.log >&2; \
	python3 tests/tools/summarize.py $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) --junit $(BUILD)/pytest.xml \
	  --junit $(FUZZ_BUILD)/fuzz.xml || rc=1; \
	exit $$rc

test-tsan: build-tsan
	@rc=0; \
	meson test -C $(TSAN_BUILD) --no-rebuild --print-errorlogs --num-processes 2 $(TSAN_TESTS) || rc=1; \
	python3 tests/tools/summarize.py $(TSAN_BUILD) || rc=1; \
	exit $$rc

fuzz: build-fuzz
	tests/fuzz/run.sh --build $(FUZZ_BUILD) --seconds $(FUZZ_SECONDS)

# orbax-checkpoint, flax, jax (CPU) and tensorstore for bench/tools_compare.py, in a venv of
# their own so that their pins never have to agree with the tests'.
VENV_BENCH := .venv-bench
$(VENV_BENCH)/.installed: bench/requirements.txt
	python3 -m venv $(VENV_BENCH)
	$(VENV_BENCH)/bin/pip install -q --disable-pip-version-check -r bench/requirements.txt
	touch $@

venv-bench: deps $(VENV_BENCH)/.installed

# Every benchmark, sized to finish in about 40 minutes (pods_bench.py: ~10, sharded_bench.py: 7.5, torch_bench.py: ~6, restore_bench.py: ~4, incremental_bench.py: 3, tiers_bench.py: 2, gcs_restore_bench.py: ~1) on a 2-core VM; tables go to
# bench/results/*.md (seed_experiment also writes its traces and SVG timelines there).
# tools_compare runs one repetition here; the committed bench/results/tools.md is its
# three-repetition run (`--reps 3 --compute-kind idle,busy`, about 12 minutes on its own).
# The naive thread-per-save mode runs on the local disk only: against the emulator it took
# over 6 minutes alone.
# The benchmark programs are not built by default (make test does not need them).
BENCH_PROGRAMS := bench/runtime_bench bench/checkpoint_bench bench/micro bench/http_sink bench/upload_bench \
  bench/multihost_bench
bench: build venv venv-bench
	ninja -C $(BUILD) $(BENCH_PROGRAMS)
	@mkdir -p bench/results; start=$$SECONDS; rc=0; \
	step() { local t=$$SECONDS; "$$@" || { rc=1; echo "make bench: FAILED: $$*" >&2; }; \
	  echo "make bench: $$1 took $$((SECONDS - t)) s" >&2; }; \
	step $(BUILD)/bench/runtime_bench --size-mib 1024 --rounds 3 > bench/results/runtime.md; \
	step $(BUILD)/bench/checkpoint_bench --sizes-gib 1 --saves 3 > bench/results/checkpoint.md; \
	step $(BUILD)/bench/micro > bench/results/micro.md; \
	step $(BUILD)/bench/upload_bench --quick > bench/results/upload-quick.md; \
	step $(PYTHON) bench/first_save_bench.py --python-path $(BUILD)/python > bench/results/first_save.md; \
	step $(PYTHON) bench/export_bench.py --ckptio $(BUILD)/src/cli/ckptio --python-path $(BUILD)/python \
	  > bench/results/export.md; \
	step $(PYTHON) bench/incremental_bench.py --gcs --python-path $(BUILD)/python > bench/results/incremental.md; \
	step $(PYTHON) bench/tiers_bench.py --python-path $(BUILD)/python > bench/results/tiers.md; \
	step $(PYTHON) bench/resume_bench.py --python-path $(BUILD)/python > bench/results/resume.md; \
	step $(PYTHON) bench/borrow_write_bench.py --python-path $(BUILD)/python > bench/results/borrow_write.md; \
	step $(PYTHON) bench/torch_bench.py --python-path $(BUILD)/python > bench/results/torch.md; \
	SEED=$(BUILD)/bench/seed/ckptio-seed step bench/seed_experiment --only local --saves 10 --out bench/results; \
	SEED=$(BUILD)/bench/seed/ckptio-seed step bench/seed_experiment --only gcs --modes blocking,ckptio,ckptio-borrow --saves 6 \
	  --out bench/results; \
	step $(VENV_BENCH)/bin/python bench/tools_compare.py --reps 1 --compute-kind idle,busy \
	  --ckptio-python $(BUILD)/python --out bench/results/tools.md > /dev/null; \
	step $(VENV_BENCH)/bin/python bench/sharded_bench.py --size-gib 1 --processes 2 --ckptio-python $(BUILD)/python \
	  --out bench/results/sharded.md > /dev/null; \
	step $(PYTHON) bench/pods_bench.py --size-gib 1 --saves 10 --compute 2 --ckptio-python $(BUILD)/python \
	  --out bench/results/pods.md > /dev/null; \
	step $(VENV_BENCH)/bin/python bench/restore_bench.py --sizes-gib 1,4,8 --reps 1 --ckptio-python $(BUILD)/python \
	  --torch-python $(PYTHON) --out bench/results/restore.md > /dev/null; \
	step $(VENV_BENCH)/bin/python bench/gcs_restore_bench.py --size-mib 1024 --reps 1 --ckptio-python $(BUILD)/python \
	  --out bench/results/gcs_restore.md > /dev/null; \
	rm -rf bench/results/tmp; \
	echo "make bench: $$((SECONDS - start)) s in all; load average $$(cut -d' ' -f1-3 /proc/loadavg)" >&2; \
	cat bench/results/tools.md; exit $$rc

# The wheel (packaging/README.md): packaging/build-deps.sh makes a glibc 2.31 sysroot and the
# static libraries (curl for HTTP(S) only, nghttp2, ISA-L; OpenSSL and liburing from Debian's
# archives) once into $(WHEEL_DIR)/deps; packaging/build-wheel.sh builds with meson-python
# against them and has auditwheel check and tag the result. WHEEL_PYTHON picks the Python
# (cp311 here). The sources come from Debian's archive (a private apt configuration).
WHEEL_DIR ?= build-wheel
WHEEL_PYTHON ?= python3
WHEEL_APT_PACKAGES := nasm dpkg-dev debootstrap binutils
wheel: deps
	@.ci/ensure-deps.sh $(WHEEL_APT_PACKAGES)
	packaging/build-wheel.sh --dir $(WHEEL_DIR) --python $(WHEEL_PYTHON)

# The Debian root (tests/wheel/make_root.sh: debootstrap, about 2 minutes, mostly downloads) is
# made while the wheel compiles (unless `make wheel-root` made it before: .ci/run does, during
# make test), and kept in $(WHEEL_DIR)/root-bookworm; the tests run on an overlay of it, as root
# (mount, chroot), with the GCS emulator of .venv on the host.
wheel-root:
	@.ci/ensure-deps.sh $(WHEEL_APT_PACKAGES)
	tests/wheel/make_root.sh $(WHEEL_DIR)/root-bookworm

test-wheel: deps venv
	@.ci/ensure-deps.sh $(WHEEL_APT_PACKAGES)
	@mkdir -p $(WHEEL_DIR); start=$$SECONDS; \
	tests/wheel/make_root.sh $(WHEEL_DIR)/root-bookworm > $(WHEEL_DIR)/make_root.log 2>&1 & root=$$!; \
	if ! packaging/build-wheel.sh --dir $(WHEEL_DIR) --python $(WHEEL_PYTHON); then wait $$root; exit 1; fi; \
	if ! wait $$root; then cat $(WHEEL_DIR)/make_root.log >&2; exit 1; fi; cat $(WHEEL_DIR)/make_root.log >&2; \
	echo "make test-wheel: wheel and root ready after $$((SECONDS - start)) s" >&2; \
	tag=$$($(WHEEL_PYTHON) -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")'); rc=0; \
	CKPTIO_WHEEL=$$(ls $(WHEEL_DIR)/wheelhouse/ckptio-*-$$tag-$$tag-manylinux_*.whl) \
	CKPTIO_SDIST=$$(ls $(WHEEL_DIR)/sdist/ckptio-*.tar.gz) CKPTIO_TEST_ROOT=$(CURDIR)/$(WHEEL_DIR)/root-bookworm \
	CKPTIO_WHEEL_TOOLS=$(CURDIR)/$(WHEEL_DIR)/venv-$$tag/bin \
	  $(PYTHON) -m pytest -q -s tests/wheel -p no:cacheprovider --junitxml=$(WHEEL_DIR)/pytest.xml || rc=1; \
	echo "make test-wheel: $$((SECONDS - start)) s in all" >&2; \
	python3 tests/tools/summarize.py --junit $(WHEEL_DIR)/pytest.xml || rc=1; exit $$rc

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD) $(VENV)
