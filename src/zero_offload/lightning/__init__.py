"""Lightning on zero-offload: ``lightning.Trainer(strategy=ZeroOffloadStrategy(config=...))``.

    from zero_offload.lightning import ZeroOffloadStrategy
    trainer = lightning.Trainer(strategy=ZeroOffloadStrategy(config={"zero_optimization": {"stage": 3}}))
    trainer.fit(module)

Needs the ``lightning`` extra (``pip install 'zero-offload[lightning]'``); ``import zero_offload`` does not import
this package. See docs/lightning.md.
"""
try:
    import lightning  # noqa: F401
except ImportError as e:    # pragma: no cover - exercised only where lightning is missing
    raise ImportError("zero_offload.lightning needs lightning: pip install 'zero-offload[lightning]'") from e

from zero_offload.lightning.precision import ZeroOffloadPrecision
from zero_offload.lightning.strategy import ZeroOffloadStrategy

__all__ = ["ZeroOffloadStrategy", "ZeroOffloadPrecision"]
