"""`gpu_validate.py`'s first act: build the native libraries in a checkout that lacks them (no network), and
report ``native_available()``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["ensure_native", "native_report"]

ROOT = Path(__file__).resolve().parent.parent


def ensure_native(root: Path = ROOT) -> dict:
    """Build the native libraries in ``root`` (a checkout: ``setup.py``, ``src/zero_offload``) when one is missing.

    Runs ``python setup.py build_ext --inplace`` in ``root`` (no network: setuptools and a C compiler), which
    puts the ``.so`` files next to their C sources, where the loaders look. Skipped when every library is
    there, or under ``ZERO_OFFLOAD_NO_NATIVE=1`` (the run is meant to use the fallbacks). Never raises: a build
    that fails is recorded and the run goes on with the fallbacks, which the report then shows.

    Returns:
        {"missing": names missing before, "built": whether a build ran, "returncode": its exit status or None,
        "still_missing": names missing after, "log": the build's last output lines (on failure)}.
    """
    from zero_offload.native_files import missing_libraries, native_disabled
    package = root / "src" / "zero_offload"
    missing = missing_libraries(package)
    result = {"missing": missing, "built": False, "returncode": None, "still_missing": missing, "log": []}
    if not missing:
        return result
    if native_disabled():
        print(f"gpu_validate: native libraries missing ({', '.join(missing)}); not built: "
              f"ZERO_OFFLOAD_NO_NATIVE is set", flush=True)
        return result
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    print(f"gpu_validate: native libraries missing ({', '.join(missing)}): building them with "
          f"`{' '.join(cmd[1:])}` in {root}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        code, text = -1, f"{type(e).__name__}: {e}"
    still = missing_libraries(package)
    result.update(built=True, returncode=code, still_missing=still)
    if code != 0 or still:
        result["log"] = text.strip().splitlines()[-20:]
        print(f"gpu_validate: the build left {', '.join(still) or 'nothing'} missing (exit {code}); running on "
              f"the fallbacks. Its last lines:\n  " + "\n  ".join(result["log"]), flush=True)
    else:
        print("gpu_validate: built " + ", ".join(missing), flush=True)
    return result


def native_report(build: dict) -> dict:
    """``native_available()`` of both libraries in this process, with the build record of `ensure_native`."""
    from zero_offload.native import native_available
    return {"available": native_available(), "build": build}
