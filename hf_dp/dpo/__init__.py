"""DP preference tuning with TRL (the ``sft`` extra: ``pip install -e ".[sft]"``): :class:`DPDPOTrainer` /
:class:`DPDPOConfig` (direct preference optimization) and :class:`DPRewardTrainer` / :class:`DPRewardConfig` (reward
models), one preference pair = one example (docs/dpo.md)."""

from hf_dp.dpo.config import DPO_FLAGS, LOSS_TYPES, REWARD_FLAGS, DPDPOConfig, DPRewardConfig
from hf_dp.dpo.reward import DPRewardTrainer
from hf_dp.dpo.trainer import DPDPOTrainer

__all__ = ["DPDPOConfig", "DPDPOTrainer", "DPO_FLAGS", "DPRewardConfig", "DPRewardTrainer", "LOSS_TYPES", "REWARD_FLAGS"]
