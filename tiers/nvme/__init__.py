"""The NVMe tier (:mod:`kvstore.tiers.nvme.tier` has its design); the
package's public names."""
from kvstore.tiers.nvme.compactor import CheckReport, NvmeCounters
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.nvme.tier import NvmeTier

__all__ = ["NvmeConfig", "NvmeTier", "CheckReport", "NvmeCounters"]
