"""`python -m fsdp_exp.gpu_session`: fsdp_exp.commands.gpu_session."""

import sys

from fsdp_exp.commands.gpu_session import main

if __name__ == "__main__":
    sys.exit(main())
