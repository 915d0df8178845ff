import os
import sys

if __name__ == "__main__":
    if "RANK" not in os.environ and not {"-h", "--help", "--hydra-help", "--info", "--cfg", "-c"} & set(sys.argv[1:]):
        from fsdp_exp.launcher.rank_server import start_rank_server

        start_rank_server()
    from fsdp_exp.cli import command

    command()
