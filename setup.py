from setuptools import find_packages, setup

import re
from pathlib import Path

version = re.search(r'__version__ = "([^"]+)"', Path("tilecraft/__init__.py").read_text()).group(1)

setup(
    name="tilecraft",
    version=version,
    description="DeepSeek-class inference kernels written once in a portable tile vocabulary (TileLang)",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tilecraft", "ops", "ops.*", "codegen", "codegen.*", "backends", "backends.*",
                                    "model", "model.*", "runtime", "runtime.*", "bench", "bench.*"]),
    install_requires=[
        "tilelang==0.1.15",
        "torch>=2.4",
        "numpy>=1.26",
        "cffi>=1.16",
        "tqdm>=4.66",
        "safetensors>=0.4",
    ],
    extras_require={
        "test": ["pytest==9.0.3", "pytest-xdist==3.8.0", "hypothesis==6.155.2", "transformers==5.17.0", "safetensors==0.8.0"],
        # nvcc + headers + disassemblers from pip: build and inspect kernels with no CUDA toolkit
        "cuda": ["nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-cccl==13.0.85",
                 "nvidia-cuda-cuobjdump==13.2.86", "nvidia-cuda-nvdisasm==13.2.86"],
        "bench": ["matplotlib>=3.8"],
    },
)
