"""The ``kvgate`` command line: tooling around the library packages.

``gateway/``, ``routing/`` and ``kvindex/`` hold no argument parsing and no
``__main__``; the commands that run them live here (``kvgate serve``, ``kvgate
index``) or in ``bench/`` (``kvgate sim``, ``kvgate bench``), wired in ``main.py``.
"""
