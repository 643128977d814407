"""Builds the optional native host Adam kernel; all other metadata lives in pyproject.toml.

The kernel is plain C loaded with ctypes (no Python headers used). It is built with OpenMP when the compiler
has it and retried without (one thread) when not; if no C compiler works at all the install still succeeds
(``optional=True``) and `zero_offload.optim.fused_adam_step` falls back to torch with a warning.
No ``-march``: the C file carries AVX-512 / AVX2 / portable versions and picks one at run time.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = {"unix": (["-fopenmp"], ["-fopenmp"]), "msvc": (["/openmp"], [])}
BASE = {"unix": ["-O2", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=default"], "msvc": ["/O2", "/fp:precise"]}


class BuildKernel(build_ext):
    """Compile with OpenMP, then without it, before giving up (optional=True turns the last error into a warning)."""

    def build_extension(self, ext):
        kind = "msvc" if self.compiler.compiler_type == "msvc" else "unix"
        omp_c, omp_l = OPENMP[kind]
        ext.extra_compile_args = BASE[kind] + omp_c
        ext.extra_link_args = list(omp_l)
        try:
            return super().build_extension(ext)
        except Exception as exc:  # CompileError / LinkError: most often no OpenMP runtime
            self.warn(f"building {ext.name} with OpenMP failed ({exc}); retrying single-threaded")
        ext.extra_compile_args = BASE[kind]
        ext.extra_link_args = []
        return super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "zero_offload.optim._native._fused_adam",
            sources=["src/zero_offload/optim/_native/fused_adam.c"],
            libraries=["m"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernel},
)
