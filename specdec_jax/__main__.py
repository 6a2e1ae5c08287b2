"""``python -m specdec_jax``: the application's command line (:mod:`specdec_jax.app.cli`)."""

from specdec_jax.app.cli import main

if __name__ == "__main__":
  raise SystemExit(main())
