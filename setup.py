"""Build step that pyproject.toml cannot express: the startup hook files at the wheel's root.

The metadata lives in pyproject.toml. What stays here: ``attn_overlay.pth`` (and
``attn_overlay.start`` for Python 3.15+) must sit at the root of the wheel's purelib, i.e.
directly in site-packages, or the interpreter never reads them. ``data_files`` would put them
under the environment prefix instead, so build_py copies them into the build directory next to
the packages; being in the wheel's RECORD, ``pip uninstall`` removes them again. MANIFEST.in
puts them in the sdist, so a wheel built from the sdist carries them too.
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


setup(cmdclass={"build_py": build_py_with_startup_files})
