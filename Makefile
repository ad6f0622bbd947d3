# fusekit front door. On a fresh machine:
#   make test   set up dependencies into .deps/, build, run the test suite (GPU tests skip without a GPU)
#   make run    set up, build the GPT trainer, train: the tiny model on the CPU (GPT-2 124M shapes for
#               a short run where a GPU exists), then sample text (apps/train_gpt/README.md)
#   make check  set up, build, run `fusekit check` and, where a GPU exists, `fusekit bench`
BUILD ?= build
JOBS ?= $(shell nproc)
CUDA_HOME ?= /usr/local/cuda
export PATH := $(CUDA_HOME)/bin:$(PATH)

.PHONY: all deps configure build test run check clean

all: build

deps:
	@bash scripts/setup_deps.sh

$(BUILD)/build.ninja: deps CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc

configure: $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	bash scripts/python_test.sh
	bash scripts/package_test.sh $(BUILD)

# Only the trainer's targets: the library and the program (no tests, no benchmarks). Without a GPU
# the trainer runs on the CPU backend, so the library is built without its CUDA kernels
# (-DFUSEKIT_CUDA_KERNELS=OFF, in $(BUILD)-cpu): a minute or two on 2 cores instead of most of an
# hour. TRAIN_ARGS passes options, e.g. make run TRAIN_ARGS="--steps 600 --save ckpt.bin".
HAVE_GPU := $(shell ls /dev/nvidia0 2>/dev/null)
RUN_BUILD := $(if $(HAVE_GPU),$(BUILD),$(BUILD)-cpu)
run: deps
	cmake -S . -B $(RUN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc \
	  $(if $(HAVE_GPU),,-DFUSEKIT_CUDA_KERNELS=OFF)
	cmake --build $(RUN_BUILD) -j $(JOBS) --target train_gpt
	$(RUN_BUILD)/apps/train_gpt/train_gpt $(TRAIN_ARGS)

check: build
	$(BUILD)/fusekit ops
	$(BUILD)/fusekit check
	@if $(BUILD)/fusekit bench --help >/dev/null 2>&1 && [ -n "$$(ls /dev/nvidia0 2>/dev/null)" ]; then \
	  $(BUILD)/fusekit bench --json $(BUILD)/bench.json; \
	else echo "fusekit bench: skipped (no GPU on this machine)"; fi

clean:
	rm -rf $(BUILD)
