"""DP supervised fine-tuning with TRL (the ``sft`` extra: ``pip install -e ".[sft]"``): :class:`DPSFTTrainer`,
:class:`DPSFTConfig`."""

from hf_dp.sft.config import SFT_FLAGS, DPSFTConfig
from hf_dp.sft.trainer import DPSFTTrainer

__all__ = ["DPSFTConfig", "DPSFTTrainer", "SFT_FLAGS"]
