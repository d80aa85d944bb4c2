"""hyper_parallel_ms: DTensor, device meshes and tensor parallelism for MindSpore."""
import os

from setuptools import find_packages, setup

setup(
    name="hyper_parallel_ms",
    version="0.1.0",
    description="MindSpore-first distributed tensors (DeviceMesh, Shard/Replicate/Partial) and "
                "differentiable collectives for Ascend, testable on CPU",
    long_description=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"),
                          encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hyper_parallel_ms", "hyper_parallel_ms.*"]),
    python_requires=">=3.9,<3.12",
    install_requires=["mindspore>=2.8,<2.11", "numpy>=1.21,<2"],  # 2.7 has no per-tensor op hook
    extras_require={
        # the suite builds the docs (tests/test_docs.py), so the test extra holds the docs tools too;
        # scripts/test.sh runs the test files on two pytest workers (pytest-xdist)
        "test": ["pytest>=7", "pytest-xdist>=3", "sphinx>=7", "myst-parser>=2"],
        "docs": ["sphinx>=7", "myst-parser>=2"],
    },
    license="Apache-2.0",
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
