"""Sphinx configuration of the celery-fenced documentation."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "celery-fenced"
author = "celery-fenced developers"
release = "0.1.0"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"undoc-members": False}
napoleon_google_docstring = True
html_theme = "alabaster"
exclude_patterns = ["_build"]
html_static_path = ["_static"]
nitpicky = False
