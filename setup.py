"""Packaging: every package of the project is installed under the ``deepwell`` namespace.

The repository keeps its top-level folders (``kernels/``, ``engine_service/``, ``gateway/``,
``kvcache_daemon/``); installed, they are ``deepwell.kernels``, ``deepwell.engine_service``,
``deepwell.gateway`` and ``deepwell.kvcache_daemon``, so nothing generic lands in
site-packages (Hugging Face's ``kernels`` distribution, which transformers >= 5.25 depends
on, installs a top-level ``kernels``). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("kernels", "engine_service", "gateway", "kvcache_daemon")

packages = find_packages(include=["deepwell", "deepwell.*"])
package_dir = {"deepwell": "deepwell"}
for folder in FOLDERS:
    package_dir[f"deepwell.{folder}"] = folder
    packages += [f"deepwell.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

setup(packages=packages, package_dir=package_dir)
