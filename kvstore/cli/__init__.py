"""The ``kvstore`` command: the group and the small commands (main.py), one
module per command group: ``serve`` (serve.py), ``demo`` (demo.py),
``bench`` (bench.py); the file formats of ``kvstore keys`` (keyfiles.py)."""
