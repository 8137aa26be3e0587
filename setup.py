"""attn-overlay: a patched-fork overlay of transformers' generation internals.

Packaging notes (why this file does more than list packages):
- ``patches/`` lives at the top of the repo but installs as ``overlay.patches``: a top-level
  ``patches`` package in users' site-packages would be too generic a name.
- The startup hook (``attn_overlay.pth``, plus ``attn_overlay.start`` for Python 3.15+) must sit at
  the root of the wheel's purelib, i.e. directly in site-packages, or the interpreter never reads
  it. ``data_files`` would put it under the environment prefix instead, so build_py copies it into
  the build directory next to the packages; being in the wheel's RECORD, ``pip uninstall``
  removes it again.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP_FILES = ("attn_overlay.pth", "attn_overlay.start")


class build_py_with_startup_files(build_py):
    def run(self):
        super().run()
        for name in STARTUP_FILES:
            self.copy_file(os.path.join(HERE, name), os.path.join(self.build_lib, name), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, n) for n in STARTUP_FILES]


def read(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


setup(
    name="attn-overlay",
    version="0.1.0",
    description="Fixes for transformers' generate() on accelerators, applied to your pinned transformers",
    long_description=read("README.md"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["overlay", "overlay.patches", "overlay.testing", "overlay.doctor"],
    package_dir={"overlay": "overlay", "overlay.patches": "patches"},
    package_data={"overlay.testing": ["*.cpp"]},
    py_modules=["_attn_overlay_startup"],
    cmdclass={"build_py": build_py_with_startup_files},
    install_requires=[
        "packaging>=22",
        # The patched libraries. Deliberately unpinned: the overlay gates itself on the exact
        # installed release, and must never drag users' pinned transformers/torch along.
        "transformers>=5.0",
        "torch>=2.4",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "nox", "accelerate", "ninja", "matplotlib"],
        # overlay.testing's fake device compiles a small C++ backend with torch's extension
        # builder, which needs ninja; without it the slower pure-Python backend is used.
        "testing": ["ninja"],
        "bench": ["matplotlib"],
        # Multi-device / tensor-parallel users: accelerate. Neuron (trn2) users also need
        # torch-neuronx, which is published on AWS's own package index, not here: install it
        # from there first (see the README), then attn-overlay.
        "multidevice": ["accelerate"],
    },
    entry_points={"console_scripts": ["attn-overlay=overlay.cli:main"]},
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
