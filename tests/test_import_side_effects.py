"""Importing siq_celery changes nothing outside the package: kombu's Redis transport is
patched, and Celery's signals get their receivers, only once an interval task is in use
(its first bind to an app: a worker's start, a producer's first use of its tasks).

Each check runs in a fresh interpreter, since the test process has long imported and
used everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Snapshots of what siq_celery may patch or connect: the identity of kombu's patch
#: targets, and each Celery signal's receivers named by their module.
SNAPSHOT = textwrap.dedent(
    """
    import json, weakref
    from celery import signals
    from celery.utils.dispatch import Signal
    from kombu.transport import redis as transport, virtual

    TARGETS = [
        (transport.Channel, "_put"), (transport.Channel, "_purge"), (transport.Channel, "_delete"),
        (transport.QoS, "append"), (transport, "time"), (transport.MultiChannelPoller, "on_readable"),
        (transport.MultiChannelPoller, "_pause_brpop"),
    ]

    def kombu():
        return {f"{getattr(o, '__name__', o)}.{a}": repr(getattr(o, a, None)) for o, a in TARGETS}

    def receivers():
        out = {}
        for name, signal in sorted(vars(signals).items()):
            if not isinstance(signal, Signal):
                continue
            found = []
            for _, ref in signal.receivers:
                fn = ref() if isinstance(ref, weakref.ReferenceType) else ref
                found.append(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")
            out[name] = sorted(found)
        return out

    def snapshot():
        return {"kombu": kombu(), "receivers": receivers()}
    """
)


def run(code: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SNAPSHOT + textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def changes(before: dict[str, dict[str, object]], after: dict[str, dict[str, object]]) -> list[str]:
    found = [f"kombu {k}: {v} -> {after['kombu'][k]}" for k, v in before["kombu"].items() if after["kombu"][k] != v]
    for signal, names in after["receivers"].items():
        added = sorted(set(names) - set(before["receivers"].get(signal, [])))  # type: ignore[arg-type]
        found += [f"celery.signals.{signal}: {name}" for name in added]
    return found


def test_importing_every_module_changes_nothing_outside_the_package() -> None:
    result = run(
        """
        import importlib, pkgutil
        before = snapshot()
        import siq_celery
        imported, skipped = [], []
        for module in pkgutil.walk_packages(siq_celery.__path__, "siq_celery."):
            try:
                importlib.import_module(module.name)
                imported.append(module.name)
            except ImportError as exc:  # an optional dependency not installed here
                skipped.append(f"{module.name}: {exc}")
        print(json.dumps({"before": before, "after": snapshot(), "imported": imported, "skipped": skipped}))
        """
    )
    found = changes(result["before"], result["after"])  # type: ignore[arg-type]
    print(f"\n{len(result['imported'])} modules imported (skipped: {result['skipped']}); changed: {found}")  # type: ignore[arg-type]
    assert "siq_celery.tasks.worker_hooks" in result["imported"] and "siq_celery.tasks.task" in result["imported"]  # type: ignore[operator]
    assert found == []


def test_binding_an_interval_task_installs_the_guards_once() -> None:
    """The worker and producer paths install them: an IntervalTask's first bind to an app."""
    result = run(
        """
        from celery import Celery
        from siq_celery import IntervalTask
        def bind(name):
            app = Celery(name, broker="memory://", set_as_current=False)

            @app.task(base=IntervalTask, interval="1s")
            def tick():
                pass

            app.finalize()
            return snapshot()

        before = snapshot()
        once, twice = bind("bound"), bind("other")
        print(json.dumps({"before": before, "once": once, "twice": twice}))
        """
    )
    found = changes(result["before"], result["once"])  # type: ignore[arg-type]
    print(f"\nafter the first bind: {found}")
    assert any(line.startswith("kombu Channel._put") for line in found)
    assert any("worker_init: siq_celery.tasks.worker_hooks" in line for line in found)
    assert changes(result["once"], result["twice"]) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("plugin", ["entry point", "import"])
def test_the_pytest_plugin_leaves_kombu_untouched(plugin: str, tmp_path: Path) -> None:
    """A pytest run of an environment where siq_celery is installed loads its plugin: that
    patches nothing of kombu's."""
    if plugin == "import":
        result = run(
            """
            before = snapshot()
            import siq_celery.pytest_plugin
            print(json.dumps({"before": before, "after": snapshot()}))
            """
        )
        assert changes(result["before"], result["after"]) == []  # type: ignore[arg-type]
        return
    test = tmp_path / "test_kombu_untouched.py"
    test.write_text(
        "import sys\n"
        "from kombu.transport import redis as transport\n\n"
        "def test_untouched():\n"
        "    assert 'siq_celery.pytest_plugin' in sys.modules\n"
        "    assert transport.Channel._put.__module__ == 'kombu.transport.redis', transport.Channel._put\n"
        "    assert transport.MultiChannelPoller.on_readable.__module__ == 'kombu.transport.redis'\n"
        "    assert transport.time.__module__ == 'time', transport.time\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]


def test_the_celery_command_guards_the_transport_for_a_purge() -> None:
    """``celery -A app purge`` binds no task: loading the ``siq`` command (what every
    ``celery`` command does through its ``celery.commands`` entry point) puts the transit
    guard in place, so a purge drops its records, with no signal receiver connected."""
    result = run(
        """
        from importlib.metadata import entry_points
        before = snapshot()
        import siq_celery.cli.celery_command
        imported = snapshot()
        (command,) = [ep for ep in entry_points(group="celery.commands") if ep.name == "siq"]
        group = command.load()
        print(json.dumps({"before": before, "imported": imported, "loaded": snapshot(), "name": group.name}))
        """
    )
    assert result["name"] == "siq"
    assert changes(result["before"], result["imported"]) == []  # type: ignore[arg-type]
    found = changes(result["imported"], result["loaded"])  # type: ignore[arg-type]
    print(f"\nafter loading the celery command: {found}")
    assert any(line.startswith("kombu Channel._purge") for line in found)
    assert not any(line.startswith("celery.signals") for line in found)


def test_the_test_app_built_in_the_test_process_patches_nothing_of_it() -> None:
    """The integration tests' app (tests/apps/geo.py) injects faults into the worker that
    imports it. Built by the test process as the publisher, with the same environment, it
    must patch nothing there: a patched ``Signature.apply_async`` outlived its test and
    reported every later re-publish to that test's stopped Redis (the JSON, plugin and
    Retry-After tests then failed, in a whole-suite run only)."""
    import logging

    from celery import signals
    from celery.canvas import Signature
    from kombu.transport import redis as transport

    from siq_celery.tasks.task import install
    from tests.apps.geo import make_app

    install()  # siq_celery's own patches, made at the first bind of an interval task, first
    siq_logger = logging.getLogger("siq_celery")
    before = (Signature.apply_async, transport.QoS.append, siq_logger.level, len(signals.task_prerun.receivers))
    env = {
        "SIQ_TEST_REFUSE_REPUBLISHES": "0@0", "SIQ_TEST_DIE_IN_TRANSIT": "3", "SIQ_TEST_DEBUG_SIQ": "1",
        "SIQ_TEST_TRACE_PRERUN": "1", "SIQ_TEST_RECORD": "redis://127.0.0.1:1/0",
    }  # fmt: skip
    make_app(env).finalize()
    after = (Signature.apply_async, transport.QoS.append, siq_logger.level, len(signals.task_prerun.receivers))
    assert after == before
