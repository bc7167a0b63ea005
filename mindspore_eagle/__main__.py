"""``python -m mindspore_eagle`` = the ``mindspore-eagle`` console script (see :mod:`mindspore_eagle.cli`)."""
from mindspore_eagle.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
