"""Sampled continuations of a fixed public prompt from the trained model (``recipes/clm.py``'s summary).

Generation reads only the released model and a public prompt: post-processing of a DP output, which costs no
privacy. The sampling is seeded (``--generation_seed``) in a forked RNG state, so the samples are reproducible for a
given model and nothing else in the run draws from the same stream.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model saw its training texts begin: with the tokenizer's start token (bos, or [CLS] for a
    BERT tokenizer) and without the end token it appends ([SEP] / eos), so that the model continues the text."""
    ids = list(tokenizer(prompt, add_special_tokens=True, return_token_type_ids=False)["input_ids"])
    end = {t for t in (tokenizer.eos_token_id, tokenizer.sep_token_id) if t is not None}
    while len(ids) > 1 and ids[-1] in end:
        ids.pop()
    return ids


@torch.no_grad()
def sample_continuations(model, tokenizer, prompt: str, num: int = 3, max_new_tokens: int = 20, seed: int = 0,
                         top_k: int = 50) -> list[str]:
    """``num`` continuations of ``prompt`` by top-k sampling (``model.generate``), decoded without special tokens,
    newlines shown as spaces (one summary line each)."""
    if num <= 0:
        return []
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, prompt)
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
        logger.warning("the sample prompt %r has words the tokenizer does not know (%s): the samples continue "
                       "unknown tokens", prompt, tokenizer.unk_token)
    ids = torch.tensor([ids], device=device)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    kwargs: dict[str, Any] = dict(do_sample=True, top_k=top_k, max_new_tokens=max_new_tokens, num_return_sequences=num,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(out, skip_special_tokens=True)
    return [" ".join(t.split()) for t in texts]
