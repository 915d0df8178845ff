"""`python -m fsdp_exp.check_gpu`: fsdp_exp.commands.check_gpu."""

import sys

from fsdp_exp.commands.check_gpu import main

if __name__ == "__main__":
    sys.exit(main())
