"""`mlxspec` and `python -m mlxspec`: the command line, started so that MLX gets the fast BLAS.

On Linux CPU the process re-executes itself once with OpenBLAS preloaded
(`mlxspec.blas.reexec_with_openblas`). That only works before MLX is imported, and the CLI
module imports it, so this entry point does the re-exec first and imports the CLI after.
"""

from __future__ import annotations

import sys

from mlxspec.blas import reexec_with_openblas


def main(argv=None) -> int:
    reexec_with_openblas(sys.argv[1:] if argv is None else list(argv))
    from mlxspec.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
