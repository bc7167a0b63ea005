"""``python -m mindspore_eagle.bench ...`` = ``mindspore-eagle bench ...`` (see mindspore_eagle.bench)."""
import sys

from mindspore_eagle.bench import cli_main

if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
