"""Builds the optional C++ extension fastmm._C; without a compiler the install still works."""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build fastmm._C if possible; otherwise warn and keep the pure-Python twin."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing or broken: the twin takes over
            self._warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._warn(exc)

    @staticmethod
    def _warn(exc):
        print(
            f"WARNING: fastmm._C was not built ({exc}); the pure-Python path will be used "
            "(same behaviour, slower copies of large samples into shared memory).",
            file=sys.stderr,
        )


setup(
    ext_modules=[
        Extension(
            "fastmm._C",
            sources=["csrc/slabs.cpp"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
