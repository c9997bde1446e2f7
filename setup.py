"""Packaging beyond pyproject.toml (which holds all the metadata).

csrc/, data/ and notebooks/ stay at the top of the repository, beside the package, and every
wheel and sdist also carries them inside the package as qsa_lab/csrc, qsa_lab/data and
qsa_lab/notebooks: each is mapped to its top-level folder as a data-only package.
qsa_lab.support.package_data finds them in either place.
"""
from setuptools import find_packages, setup

BUNDLED = {"qsa_lab.csrc": "csrc", "qsa_lab.data": "data", "qsa_lab.notebooks": "notebooks"}

setup(
    packages=find_packages(include=["qsa_lab", "qsa_lab.*"]) + list(BUNDLED),
    package_dir=BUNDLED,
    package_data={"qsa_lab.csrc": ["*"], "qsa_lab.data": ["*"],
                  "qsa_lab.notebooks": ["[0-9][0-9]_*.ipynb", "README.md"]},
)
