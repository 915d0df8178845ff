"""Where fsdp_exp's own config folder is."""

from __future__ import annotations

from pathlib import Path


def find_conf_dir() -> str:
    """conf/: inside an installed package (setup.py ships it as fsdp_exp/conf), or at the
    top of the checkout (a source tree, or an editable install)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"fsdp_exp's conf/ is in neither {package} nor {package.parent}; reinstall fsdp_exp")


CONF_DIR = find_conf_dir()
