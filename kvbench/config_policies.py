"""The `cache.policy` section: each eviction policy's parameters (`kvbench.cache.policies`), keys
a `kvbench tune` study can search."""

from __future__ import annotations

from pydantic import Field

from kvbench.config_base import MAX_RATIO, Section


def _sampling(own: str, always: str, default: int = 8):
    """The `shadow_sampling` key of a policy whose order duels LRU's (`policies.shadows`)."""
    return Field(default, ge=0, description=f"One key in this many feeds the LRU and {own} shadows that"
                 f" choose the order (0: always {always}); fewer below 1024 keys or 64K tokens.")


def _history(default: float = 8.0, what: str = "Keys", more: str = ""):
    """The `history_ratio` key: the keys a policy's history remembers."""
    return Field(default, gt=0, le=MAX_RATIO,
                 description=f"{what} remembered, as a multiple of the pool's blocks{more}.")


def _entry(own: str):
    """The `shadow_entry` key of a policy whose order duels LRU's (`policies.shadows`)."""
    return Field(1.0, ge=0, le=MAX_RATIO, description="Standard deviations of the difference"
                 f" by which the {own} shadow must lead LRU's, over the last period and over 32,"
                 " before the pool leaves LRU's order (0: any lead).")


class SLRUConfig(Section):
    """Segmented LRU with a ghost history (`cache.eviction_policy: slru`)."""

    protected_ratio: float = Field(
        0.8, gt=0, lt=1, description="Most of the pool the protected segment may hold.")
    history_ratio: float = _history()
    shadow_sampling: int = _sampling("SLRU", "SLRU")
    shadow_entry: float = _entry("SLRU")


class S3FIFOConfig(Section):
    """S3-FIFO (`cache.eviction_policy: s3fifo`)."""

    small_ratio: float = Field(
        0.1, gt=0, lt=1, description="Share of the pool the small FIFO aims at.")
    max_freq: int = Field(3, ge=1, le=255, description="Accesses counted per block.")
    history_ratio: float = _history(1.0, "Ghost keys")
    shadow_sampling: int = _sampling("S3-FIFO", "S3-FIFO")
    shadow_entry: float = _entry("S3-FIFO")


class GDSFConfig(Section):
    """Depth- and chain-aware GDSF (`cache.eviction_policy: gdsf`)."""

    freq_weight: float = Field(
        1.0, ge=0, le=MAX_RATIO, description="Score gained per earlier use of the block's key.")
    max_freq: int = Field(16, ge=1, le=255, description="Uses beyond this count no more.")
    history_ratio: float = _history()
    shadow_sampling: int = _sampling("GDSF", "GDSF")
    shadow_entry: float = _entry("GDSF")


class PredictiveConfig(Section):
    """Online-learnt reuse chance per use-count class (`cache.eviction_policy: predictive`)."""

    horizon_ratio: float = Field(
        16.0, gt=0, le=MAX_RATIO,
        description="Reuse counts as soon within this many pool sizes of traffic.")
    boost: float = Field(
        4.0, ge=0, le=MAX_RATIO,
        description="Horizons a block with certain reuse is kept past LRU order.")
    max_class: int = Field(6, ge=1, le=255, description="Use counts told apart (more share the last).")
    prior: float = Field(0.2, ge=0, le=1, description="Reuse chance of a class with no data.")
    prior_weight: float = Field(
        20.0, gt=0, le=1e9, description="Pseudo-uses the prior counts for.")
    history_ratio: float = _history()
    shadow_sampling: int = _sampling("whole-boost", "the boost")
    shadow_entry: float = _entry("whole-boost")


class LRU2Config(Section):
    """LRU-2 once a shadow cache shows it beats LRU, else LRU (`cache.eviction_policy: lru2`)."""

    history_ratio: float = _history(more="; the shadow counts halve every such period")
    shadow_sampling: int = _sampling("LRU-2", "LRU-2", 4)
    shadow_entry: float = _entry("LRU-2")


class PolicyConfig(Section):
    """Parameters of each eviction policy; only the chosen one's are used."""

    slru: SLRUConfig = Field(default_factory=SLRUConfig, description="slru parameters.")
    s3fifo: S3FIFOConfig = Field(default_factory=S3FIFOConfig, description="s3fifo parameters.")
    gdsf: GDSFConfig = Field(default_factory=GDSFConfig, description="gdsf parameters.")
    predictive: PredictiveConfig = Field(
        default_factory=PredictiveConfig, description="predictive parameters.")
    lru2: LRU2Config = Field(default_factory=LRU2Config, description="lru2 parameters.")
