"""Fail-stop for swap files: after one failed read or write every later use raises at once, since the files
may hold a half-written step and only the last checkpoint is sound."""
from __future__ import annotations

__all__ = ["FailStop"]


class FailStop:
    """Mixin for the owners of swap files (`NvmeAdam`, `NvmeParamStore`): run I/O through `_guard`.

    ``fail_stop_subject`` names the files in the error (for example "NVMe optimizer states").
    """

    broken: BaseException | None = None
    fail_stop_subject = "NVMe swap files"

    def _guard(self, fn, *args):
        """``fn(*args)``, remembering the first exception it raises.

        Raises:
            RuntimeError: an earlier call failed (chained to that failure); otherwise whatever ``fn`` raises.
        """
        if self.broken is not None:
            raise RuntimeError(f"{self.fail_stop_subject} are unusable after an earlier I/O error ({self.broken}); "
                               "restart from the last checkpoint") from self.broken
        try:
            return fn(*args)
        except BaseException as e:
            self.broken = e
            raise
