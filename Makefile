# The README's two commands: `make demo` and `make test`. Both create .venv and install
# the package with what they need, so a fresh machine needs only Python 3.11 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= redis,dev

.PHONY: demo test lint unit bench bench-peers bench-publish bench-failover clean test-redis-floor test-install

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

# The store contract suite on the oldest redis-py the package declares (redis>=5.0), in a
# venv of its own: `make test` runs it on the newest; of its Cluster cases, those of a lost
# reply and of CLUSTERDOWN (redis-py before 6.0 re-sent a Cluster command after a timeout).
# (redis-py before 5.1 leaves a collected client's socket for the garbage collector, which
# Python reports at the end of the session, at random: that report alone is not a failure
# here. pytest takes a -W message literally and ':' ends it, hence the prefix every such
# report starts with.)
FLOOR_VENV ?= .venv-redis-floor
REDIS_PY_FLOOR ?= 5.0.0
$(FLOOR_VENV)/.installed-$(REDIS_PY_FLOOR): pyproject.toml
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e ".[redis]" "redis==$(REDIS_PY_FLOOR)" pytest pytest-timeout \
		pytest-rerunfailures hypothesis
	touch $@

test-redis-floor: $(FLOOR_VENV)/.installed-$(REDIS_PY_FLOOR)
	$(FLOOR_VENV)/bin/python -c "import redis; print('redis-py', redis.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow and not cluster" tests/contract \
		tests/test_redis_urls.py -W "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning"
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/contract/test_lost_reply_contract.py \
		tests/contract/test_cluster_down_contract.py \
		-W "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning"

# Install exactly as the README's Install section says, `pip install ".[redis]"` (not
# editable, no dev extras), into a fresh venv, then start a real `celery -A app worker` on a
# private Redis, run an IntervalTask through it, and run `siq demo` (.ci/install_check.py).
# The dev extras bring in what an extra may forget to declare: this is the install a user gets.
INSTALL_VENV ?= .venv-install
test-install:
	rm -rf $(INSTALL_VENV)
	$(PYTHON) -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/python -m pip install --quiet ".[redis]"
	cd $(INSTALL_VENV) && env -u PYTHONPATH ./bin/python $(CURDIR)/.ci/install_check.py

bench: install
	$(PY) bench/core.py
	$(PY) bench/fidelity.py
	$(PY) bench/parking.py
	$(PY) bench/spark.py

# siq_celery beside BullMQ (npm, pinned in bench/peers/package.json) and Celery's rate_limit:
# spacing, burst, concurrency and pools (gevent beside prefork). One or a few: make bench-peers SCENARIOS=burst
# (PEERS_ARGS for more: PEERS_ARGS="--runs 1").
SCENARIOS ?= spacing,burst,concurrency,pools
bench-peers: install
	$(PY) bench/peers.py --scenarios $(SCENARIOS) $(PEERS_ARGS)

# Publish cost of IntervalTask (with an interval; with an interval and a window quota)
# against plain apply_async, interleaved in one process (PUBLISH_ARGS: bench/publish.py -h).
bench-publish: install
	$(PY) bench/publish.py $(PUBLISH_ARGS)

# Issue 27: the state store fails over behind Sentinel (master + replica + 3 sentinels)
# under 3 worker nodes: master killed, partitioned 6 s, a lagging replica promoted; at
# 50 ms (240 tasks, 3 runs) and 5 s (10 tasks, 1 run). FAILOVER_ARGS: bench/failover.py -h.
FAULTS ?= kill,partition,lag
bench-failover: install
	$(PY) bench/failover.py --fault $(FAULTS) --interval 50ms --tasks 240 --runs 3 $(FAILOVER_ARGS)
	$(PY) bench/failover.py --fault $(FAULTS) --interval 5s --tasks 10 --runs 1 $(FAILOVER_ARGS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(INSTALL_VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
