"""conf/ stays at the top of the checkout; an installed package carries it as fsdp_exp/conf.

pyproject.toml holds everything else; it cannot add a mapped folder to the packages it finds.
"""

from setuptools import find_namespace_packages, find_packages, setup

conf_groups = [f"fsdp_exp.conf.{group}" for group in find_namespace_packages(where="conf")]
# hydra_plugins is Hydra's namespace package for plugins: fsdp_exp's sweeper lives there.
setup(packages=[*find_packages(include=["fsdp_exp*"]), "fsdp_exp.conf", *conf_groups, "hydra_plugins.fsdp_exp_sweeper"],
      package_dir={"fsdp_exp.conf": "conf"})
