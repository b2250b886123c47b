"""Command line: a thin argparse layer that builds configs and calls the package.

Subcommands register themselves in ``_COMMANDS`` through ``_add_*`` functions, one per command.
"""

from __future__ import annotations

import argparse
import sys


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="execute the notebooks headless into reports/ (HTML, PNG figures)")
    p.add_argument("--notebooks", default="notebooks", help="directory of numbered notebooks")
    p.add_argument("--out", default="reports", help="output directory")
    p.add_argument("--quick", action="store_true", help="small parameters (what the tests run)")
    p.add_argument("--only", nargs="*", help="run only notebooks whose file name contains one of these")
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    from specresearch.report import run_report

    runs = run_report(args.notebooks, args.out, quick=args.quick, only=args.only)
    total = sum(r.seconds for r in runs)
    print(f"executed {len(runs)} notebooks in {total:.0f} s; report in {args.out}/")
    return 0


_COMMANDS = [_add_report]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specresearch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
