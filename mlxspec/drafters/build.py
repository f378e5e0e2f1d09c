"""The module for a drafter config: one place that maps a lineage to its architecture file."""

from __future__ import annotations

from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.dflash2 import DFlash2Model
from mlxspec.drafters.model import DFlashModel


def make_model(c: DrafterConfig) -> DFlashModel:
    """DFlash2Model (dflash2.py) for the dflash2 lineage, else DFlashModel (model.py: DFlash, DSpark)."""
    return DFlash2Model(c) if c.lineage == "dflash2" else DFlashModel(c)
