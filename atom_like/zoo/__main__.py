"""``python -m atom_like.zoo list`` / ``python -m atom_like.zoo prepare NAME``."""

import argparse
import sys

from atom_like.cli import entry_point, fail
from atom_like.zoo.registry import MODELS, prepare, table


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atom_like.zoo", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="show every zoo model, where it lives and whether it is ready")
    p = sub.add_parser("prepare", help="build a converted model (smollm2-135m) into the cache")
    p.add_argument("name", choices=[m.name for m in MODELS.values() if m.converted])
    args = parser.parse_args(argv)
    if args.cmd == "list":
        print(table())
        return 0
    try:
        print(prepare(args.name))
    except ImportError as e:  # the converter's optional package (FileNotFoundError: entry_point)
        fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
