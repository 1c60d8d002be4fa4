"""hf_dp: differentially private fine-tuning for Hugging Face transformers.Trainer."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: keep `import hf_dp.optim` free of transformers
    if name in ("DPTrainer",):
        from .trainer import DPTrainer

        return DPTrainer
    if name in ("DPTrainingArguments",):
        from .arguments import DPTrainingArguments

        return DPTrainingArguments
    raise AttributeError(f"module 'hf_dp' has no attribute {name!r}")


__all__ = ["DPTrainer", "DPTrainingArguments", "__version__"]
