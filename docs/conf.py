"""Sphinx configuration of hyper_parallel_ms's documentation.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (or ``bash scripts/build_docs.sh``);
pages are Markdown (MyST), the API reference is generated from the docstrings by ``_ext/hpms_api.py``.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))          # the package, from this checkout
sys.path.insert(0, os.path.join(HERE, "_ext"))

project = "hyper_parallel_ms"
author = "hyper_parallel_ms contributors"
copyright = "hyper_parallel_ms contributors"
release = version = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "hpms_api"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3                           # [text](page.md#a-heading) links
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "alabaster"
html_title = "hyper_parallel_ms"
