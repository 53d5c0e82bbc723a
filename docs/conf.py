"""Sphinx configuration of the siq_celery documentation: ``make docs`` builds it into
docs/_build/html with warnings as errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # autodoc reads this checkout, installed or not

from sphinx.application import Sphinx  # noqa: E402

import siq_celery  # noqa: E402

project = "siq_celery"
author = "siq_celery developers"
copyright = "siq_celery developers"
release = version = siq_celery.__version__

# sphinx_click: the command line reference (cli.md) from the click commands themselves.
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx_click"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

# Markdown: GitHub's heading anchors (``limits.md#limit-kinds``), so a link between pages
# works in the rendered site and in the repository alike.
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
autodoc_inherit_docstrings = False  # what IntervalTask inherits is documented by Celery

html_theme = "furo"
html_title = f"siq_celery {release}"


def plain_click_help(_app: Sphinx, _ctx: object, lines: list[str]) -> None:
    """A command's help is plain text, written for a terminal: its ``*`` (a glob, ``'shop:*'``)
    and backquotes are characters, not reStructuredText markup."""
    lines[:] = [re.sub(r"([\\*`])", r"\\\1", line) for line in lines]


def setup(app: Sphinx) -> None:
    app.connect("sphinx-click-process-description", plain_click_help)
