"""`python -m fsdp_exp.compare`: fsdp_exp.commands.compare."""

import sys

from fsdp_exp.commands.compare import main

if __name__ == "__main__":
    sys.exit(main())
