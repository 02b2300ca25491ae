"""``python -m atom_like.zoo list`` / ``python -m atom_like.zoo prepare NAME``."""

import argparse
import sys

from atom_like.zoo.registry import MODELS, prepare, table


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
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
