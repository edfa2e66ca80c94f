# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3

.PHONY: demo test install deps dashboards dashboards-preview alerts kubernetes bench fuzz

demo: install
	$(PYTHON) -m exporter --demo

test: deps
	$(PYTHON) -m pytest -q

install:
	$(PYTHON) -m pip install -q -e .

# Everything the tests need: the package with its test extras, and Debian's Prometheus and Alertmanager.
deps:
	./scripts/install-test-deps
	$(PYTHON) -m pip install -q -e '.[test]'

dashboards:
	$(PYTHON) -m dashboards.build

# Every panel of both dashboards as PNGs, one per row, from a running Prometheus (no Grafana needed).
PROMETHEUS ?= http://127.0.0.1:9090
PREVIEW_DIR ?= dashboard-preview
dashboards-preview:
	$(PYTHON) -m dashboards.preview --prometheus $(PROMETHEUS) --out $(PREVIEW_DIR)

alerts:
	$(PYTHON) -m alerts.generate

# After `make alerts` and `make dashboards`: the manifests embed both.
kubernetes:
	$(PYTHON) -m deploy.kubernetes.generate

bench:
	$(PYTHON) -m pip install -q -e '.[bench]'
	$(PYTHON) -m bench.run

# Five minutes of coverage-guided fuzzing of the page path (fuzz/fuzz_parser.py says what it checks).
fuzz:
	$(PYTHON) -m pip install -q -e '.[fuzz]'
	$(PYTHON) fuzz/fuzz_parser.py -max_total_time=300
