"""The ``fedsplit`` command line: thin commands over the library packages, one module each."""
