"""``python -m specdec_jax``: run the demo (see :mod:`specdec_jax._demo` and ``--help``)."""

from specdec_jax._demo import main

if __name__ == "__main__":
  raise SystemExit(main())
