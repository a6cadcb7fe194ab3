"""MkDocs hook: drop pytest-markdown-docs' fence options before rendering.

A block the tests run as two workers opens with ```` ```python runner:TwoWorkers ````;
Python-Markdown recognises a fence only when its info string is one word, so
the words after the language are removed for the rendered page (the test
suite reads the Markdown files themselves and keeps them).
"""

import re

_FENCE_WITH_OPTIONS = re.compile(r"^(\s*```+\s*python)[ \t]+[^\n`]*$", re.MULTILINE)


def on_page_markdown(markdown, **kwargs):
    """Returns the page's Markdown with every Python fence's options removed."""
    return _FENCE_WITH_OPTIONS.sub(r"\1", markdown)
