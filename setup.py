"""Builds the optional native libraries; all other metadata lives in pyproject.toml.

Both are plain C loaded with ctypes (no Python headers used): the host Adam kernel, and the NVMe swapper's
native AIO path (Linux syscalls only; no libaio needed). If either fails to build the install still succeeds
and its caller falls back (to torch with a warning; to ``os.preadv``). The Adam kernel is built with OpenMP
when the compiler has it and retried without (one thread) when not. No ``-march``: the C file carries
AVX-512 / AVX2 / portable versions and picks one at run time.
"""
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

STAND_IN_PTH = "zero_offload_stand_in.pth"     # the DeepSpeed stand-in's startup hook (src/zero_offload_stand_in.py)

OPENMP = {"unix": (["-fopenmp"], ["-fopenmp"]), "msvc": (["/openmp"], [])}
BASE = {"unix": ["-O2", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=default"], "msvc": ["/O2", "/fp:precise"]}


class BuildKernel(build_ext):
    """Compile with OpenMP, then without it, before giving up (optional=True turns the last error into a warning)."""

    def build_extension(self, ext):
        kind = "msvc" if self.compiler.compiler_type == "msvc" else "unix"
        if not ext.name.endswith("_fused_adam"):        # only the Adam kernel runs threads of its own
            ext.extra_compile_args = BASE[kind]
            return super().build_extension(ext)
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


class BuildWithStandInHook(build_py):
    """Put the stand-in's ``.pth`` at the root of what is installed, where site-packages runs it at start-up (as
    pytest-cov ships its hook). Plain and editable installs both run build_py; an editable install keeps the
    files build_py writes outside packages only through `get_output_mapping`, so they are listed there too."""

    def run(self):
        super().run()
        self.copy_file(os.path.join("src", STAND_IN_PTH), os.path.join(self.build_lib, STAND_IN_PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, STAND_IN_PTH)]



class EditableWithStandInHook(editable_wheel):
    """``pip install -e .``: setuptools' editable wheel holds only its own path hook, so the stand-in's ``.pth`` is
    added to it (the way labscript-suite and others ship a start-up hook in editable installs). It sorts after
    ``__editable__.*.pth``, so ``src`` is on ``sys.path`` when it runs."""

    def _create_wheel_file(self, bdist_wheel):
        from wheel.wheelfile import WheelFile
        wheel_path = super()._create_wheel_file(bdist_wheel)
        with WheelFile(wheel_path, "a") as wheel:
            wheel.write(os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", STAND_IN_PTH), STAND_IN_PTH)
        return wheel_path


setup(
    ext_modules=[
        Extension(
            "zero_offload.optim._native._fused_adam",
            sources=["src/zero_offload/optim/_native/fused_adam.c", "src/zero_offload/optim/_native/accumulate.c",
                     "src/zero_offload/optim/_native/muon.c"],
            depends=["src/zero_offload/optim/_native/zo_common.h"],
            libraries=["m"],
            optional=True,
        ),
        Extension("zero_offload.nvme._native._aio", sources=["src/zero_offload/nvme/_native/aio.c"], optional=True),
    ],
    py_modules=["zero_offload_stand_in"],
    cmdclass={"build_ext": BuildKernel, "build_py": BuildWithStandInHook,
              "editable_wheel": EditableWithStandInHook},
)
