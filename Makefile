# The README's two commands: `make demo` and `make test`. Both create .venv and install
# the package with what they need, so a fresh machine needs only Python 3.11 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= redis,dev

.PHONY: demo test lint unit bench bench-peers clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

demo: install
	$(PY) -m siq_celery.demo

lint: install
	$(PY) -m ruff check siq_celery tests bench examples
	$(PY) -m ruff format --check siq_celery tests bench examples
	$(PY) -m mypy

# pytest exits 5 when a selection collects nothing (say, PYTEST_ARGS="-m spark" before
# any Spark test exists): that is not a failure of the suite.
test: lint
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests collected for '$(PYTEST_ARGS)'"; exit 0; fi; exit $$rc

bench: install
	$(PY) bench/core.py
	$(PY) bench/fidelity.py
	$(PY) bench/parking.py
	$(PY) bench/spark.py

# siq_celery beside BullMQ (npm, pinned in bench/peers/package.json) and Celery's rate_limit.
bench-peers: install
	$(PY) bench/peers.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
