"""conf/ stays at the top of the checkout; an installed package carries it as fsdp_exp/conf.

pyproject.toml holds everything else; it cannot add a mapped folder to the packages it finds.
"""

from setuptools import find_namespace_packages, find_packages, setup

conf_groups = [f"fsdp_exp.conf.{group}" for group in find_namespace_packages(where="conf")]
setup(packages=[*find_packages(include=["fsdp_exp*"]), "fsdp_exp.conf", *conf_groups],
      package_dir={"fsdp_exp.conf": "conf"})
