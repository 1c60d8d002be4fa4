"""The model folder a ``DPTrainer`` writes where HF's ``save_model`` would not write the plain model: under FSDP2 (a
checkpoint keeps the shards, a release gathers the full model: :mod:`hf_dp.clipping.sharding`) and for LoRA (the release
is the merged plain model, DP or not: an adapter alone cannot be loaded without its base). ``DPTrainer.save_model``
calls :func:`save_model_folder` and falls back to HF's own save; it then writes ``privacy.json`` and the card.
"""

from __future__ import annotations

import os

import torch

from hf_dp.clipping import sharding
from hf_dp.clipping.hooks import unwrap_for_save


def save_model_folder(args, model, fsdp: bool, trainable_info, processing_class, output_dir: str,
                      is_checkpoint: bool) -> bool:
    """Write ``output_dir``'s model (every rank takes part under FSDP2, rank 0 writes) with the tokenizer
    (``processing_class``) and the training arguments ``args``, where HF's save would not write the plain model
    (``fsdp``: the run's FSDP2 under DP, ``dp.fsdp``; ``trainable_info``: ``--trainable``'s, LoRA merged); ``False``:
    HF's ``save_model`` writes it. ``is_checkpoint``: called from ``_save_checkpoint`` (a release folder may be named
    ``checkpoint-…`` too)."""
    fsdp = fsdp and sharding.is_fsdp_model(model)
    if fsdp and is_checkpoint and not args.save_only_model:
        # FSDP2, a checkpoint: the model stays sharded (its shards are written with the optimizer's, by
        # _save_optimizer_and_scheduler: hf_dp.clipping.sharding.save_checkpoint_state); rank 0 writes its config
        def write(folder):
            model.config.save_pretrained(folder)
    elif fsdp:
        # FSDP2: the full model gathered from the shards (every rank takes part), written by rank 0 as a plain
        # save_pretrained folder (HF's own FSDP save path reads the Accelerate state, see hf_dp.clipping.sharding)
        state_dict = sharding.full_state_dict(model)

        def write(folder):
            plain = sharding.plain_release(model, state_dict)  # LoRA: merged, as without FSDP
            plain.save_pretrained(folder, state_dict=None if plain is not model else state_dict)
    elif trainable_info is not None and trainable_info.mode == "lora" and not is_checkpoint:
        def write(folder):  # the merged plain model (the training model is left untouched)
            unwrap_for_save(model).save_pretrained(folder)
    else:
        return False
    if args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        write(output_dir)
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
        if is_checkpoint:  # a release carries no pickled arguments (drop_training_args)
            torch.save(args, os.path.join(output_dir, "training_args.bin"))
    return True


def drop_training_args(output_dir: str) -> None:
    """A release (``save_model`` outside a checkpoint) holds the model, its tokenizer, the card and privacy.json: HF's
    save adds the pickled ``training_args.bin`` (loading it unpickles arbitrary objects; the run's settings are in
    privacy.json and the card), which is removed; checkpoints keep it."""
    path = os.path.join(output_dir, "training_args.bin")
    if os.path.isfile(path):
        os.remove(path)
