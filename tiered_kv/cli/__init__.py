"""The ``tiered-kv`` command line; see ``main.py``."""
