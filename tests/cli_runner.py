"""click's test runner with standard output and standard error apart, on every click the
package accepts."""

from __future__ import annotations

import inspect

from click.testing import CliRunner


def separate_runner() -> CliRunner:
    """A runner whose results have ``stdout`` and ``stderr`` apart. click 8.2 on always keeps
    them apart (and ``output`` is both); before 8.2 that takes ``mix_stderr=False``, an
    argument 8.2 removed, and then ``output`` is standard output alone: a test reads what
    goes to standard error from ``stderr``."""
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        return CliRunner(mix_stderr=False)
    return CliRunner()
