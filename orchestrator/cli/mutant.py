"""A deliberately broken build of ``spotrun run``, for ``spotrun verify --mutate``.

    python -m spotrun.orchestrator.cli.mutant --drop CATEGORY[,CATEGORY] run CONFIG ...

runs exactly ``spotrun run CONFIG ...`` except that every restore loses the named state
categories (``spotrun inventory``; ``state:<name>`` skips a registered object's restore). verify
runs its chaos run through here to prove that losing a category does not go unnoticed. Nothing
else starts this module: ``spotrun run`` has no way to drop state.
"""

from __future__ import annotations

import sys

from spotrun.orchestrator.cli.main import parser, run_parsed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--drop" or argv[2] != "run":
        sys.stderr.write("usage: python -m spotrun.orchestrator.cli.mutant --drop CATEGORY[,...] run CONFIG ...\n")
        return 2
    args = parser().parse_args(argv[2:])
    args.drop = tuple(c for c in argv[1].split(",") if c)
    return run_parsed(args)


if __name__ == "__main__":
    sys.exit(main())
