# flash_ext developer targets. Build knobs (FLASH_EXT_ARCHS, FLASH_EXT_HEADDIMS, FLASH_EXT_DTYPES,
# MAX_JOBS, ...) are read from the environment: see README.md "Build knobs".
PYTHON ?= python
OUT ?= gpu_check_out

.PHONY: install develop build test bench gpu-check instantiations clean

install:            ## install into the current environment (torch must be installed already)
	$(PYTHON) -m pip install --no-build-isolation -v .

develop build:      ## build flash_ext/_C*.so in place (incremental), for tests from the repo root
	$(PYTHON) setup.py build_ext --inplace

test:               ## README's test command
	$(PYTHON) -m pytest -q tests

bench:
	$(PYTHON) -m flash_ext.bench

gpu-check:          ## one full GPU run: make gpu-check OUT=dir
	bash tools/gpu_check.sh $(OUT)

instantiations:     ## regenerate csrc/instantiations/
	$(PYTHON) build_support/gen_instantiations.py

clean:
	rm -rf build dist *.egg-info flash_ext/_C*.so
	find flash_ext tests tools -name __pycache__ -type d -prune -exec rm -rf {} +
