"""Choosing which parameters of a Hugging Face classifier are trained.

``apply_trainable(model, trainable)`` freezes a ``*ForSequenceClassification``
model and re-enables gradients for one of the modes in :data:`TRAINABLE_MODES`:

``last_block`` (default)
    The last transformer block, plus every parameter-holding module that is
    first *called* after the last block starts (pooler, GPT-2's ``ln_f``, the
    classification head).  This is the setting of the DP-AdamW paper.
``last_k:K`` (``K`` = 1, 2, ... up to the number of blocks)
    The last ``K`` transformer blocks, plus every parameter-holding module
    first called after the first of them starts (pooler, head, ...).
    ``last_k:1`` trains what ``last_block`` trains.  With the frozen-prefix
    cache the prefix is cached below these ``K`` blocks
    (:attr:`TrainableInfo.suffix_blocks`).
``head``
    Only the classification head, i.e. every parameter that is not a
    parameter of ``model.base_model`` (e.g. BERT's ``classifier``,
    DistilBERT's ``pre_classifier`` + ``classifier``, DeBERTa's ``pooler`` +
    ``classifier``, GPT-2's ``score``).
``all``
    Every parameter.
``bias``
    BitFit: every parameter registered under the name ``bias`` (linear,
    layer-norm, ... biases) plus the whole head (as in ``head``).
Causal LMs (``*ForCausalLM``): ``last_block`` / ``last_k:K`` train the blocks and the final norm but not the
vocabulary matrices (the LM head is the output embedding, usually tied to the input embedding: ``all`` trains them);
``lora`` uses ``task_type=CAUSAL_LM`` with no ``modules_to_save`` (adapters only).

``lora``
    PEFT LoRA with ``task_type=SEQ_CLS``.  Unless a config says otherwise, the
    target modules come from PEFT's own per-architecture default mapping
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``); for model types
    missing there, hf_dp supplies the query/value projections for DistilBERT,
    ALBERT and MPNet and falls back to PEFT's ``"all-linear"`` otherwise.  The
    head modules (as in ``head``) are trained in full through PEFT's
    ``modules_to_save``.  The returned model is the ``PeftModel``.

How ``last_block`` works (architecture-generic, no attribute names):

1. *Blocks*: among all ``nn.ModuleList`` inside ``model.base_model`` whose
   children all share one class, take the one with the most parameters (ties:
   the outermost one).  The last block is its last element.
2. *Execution order*: run one tiny dummy forward (``1 x 8`` token ids, under
   ``torch.no_grad()``, in eval mode; training mode is restored afterwards)
   with forward pre-hooks that record the order in which modules are called
   for the first time.
3. Trainable = every parameter of the last block + the direct parameters of
   every module whose *first* call starts after the last block's first call
   started.

Step 3 picks the pooler, final layer norms and the head, and leaves out
everything computed before the blocks even if it is defined inside the encoder
(DeBERTa's ``rel_embeddings`` and ``encoder.LayerNorm``, MPNet's
``relative_attention_bias``, ELECTRA's ``embeddings_project``, ALBERT's
``embedding_hidden_mapping_in``).  Parameters that are read directly instead
of through a module call are attributed to the module whose forward reads them.

ALBERT shares one layer group across all depths; its ModuleList of blocks is
``albert.encoder.albert_layer_groups`` (one group by default), so its "last
block" is the (last) shared group, which is applied at every depth.  Training
it therefore changes every layer of the network, not just the top one.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

TRAINABLE_MODES: tuple[str, ...] = ("last_block", "last_k:K", "head", "all", "bias", "lora")
"""The ``--trainable`` modes; ``last_k:K`` stands for ``last_k:1``, ``last_k:2``, ... (see :func:`check_trainable`)."""

__all__ = ["TRAINABLE_MODES", "TrainableInfo", "apply_trainable", "check_trainable", "find_blocks", "lora_config_of",
           "lora_targets", "head_parameter_names", "suffix_blocks"]

_LAST_K = "last_k:"


def check_trainable(mode) -> str:
    """``mode`` if it is a ``--trainable`` mode (:data:`TRAINABLE_MODES`, ``last_k:K`` with an integer ``K >= 1``),
    else ``ValueError`` naming the valid modes.  (Whether ``K`` fits the model is checked by :func:`apply_trainable`.)"""
    if isinstance(mode, str) and mode in TRAINABLE_MODES and mode != "last_k:K":
        return mode
    if isinstance(mode, str) and mode.startswith(_LAST_K):
        k = mode[len(_LAST_K):]
        if re.fullmatch(r"[1-9][0-9]*", k):  # ASCII digits only ('²'.isdigit() is True)
            return mode
        raise ValueError(f"--trainable {mode}: K in last_k:K must be a whole number >= 1 (e.g. last_k:2), got {k!r}")
    raise ValueError(f"--trainable must be one of {', '.join(TRAINABLE_MODES)} (K = 1, 2, ...), got {mode!r}")


def lora_targets(modules, trainable: str = "lora"):
    """``--lora_target_modules`` as PEFT's ``target_modules``: ``None`` (PEFT's default for the model type), the string
    ``"all-linear"``, or a list of module names; ``ValueError`` (one sentence) for anything else or without
    ``--trainable lora`` (the flag would otherwise be ignored)."""
    if modules is None:
        return None
    if isinstance(modules, str):
        modules = [modules]
    if trainable != "lora":
        raise ValueError(f"--lora_target_modules needs --trainable lora (it names the modules LoRA adapts), "
                         f"got --trainable {trainable}")
    names = list(modules) if isinstance(modules, (list, tuple)) else None
    if not names or any(not isinstance(m, str) or not m.strip() or m != m.strip() for m in names):
        raise ValueError(f"--lora_target_modules must name one or more modules (e.g. c_attn c_fc, or all-linear), "
                         f"got {modules!r}")
    if "all-linear" in names:
        if len(names) > 1:
            raise ValueError(f"--lora_target_modules all-linear stands alone, got {names!r}")
        return "all-linear"
    return names


def lora_config_of(args) -> dict | None:
    """The LoRA keyword arguments of DPTrainingArguments (``--lora_r``, ``--lora_alpha``, ``--lora_target_modules``)
    for :func:`apply_trainable`; ``None`` unless ``--trainable lora``."""
    if args.trainable != "lora":
        lora_targets(getattr(args, "lora_target_modules", None), args.trainable)  # refused: it would be ignored
        return None
    return {"r": args.lora_r, "lora_alpha": args.lora_alpha,
            "target_modules": lora_targets(getattr(args, "lora_target_modules", None))}


def suffix_blocks(mode: str) -> int | None:
    """How many trailing transformer blocks ``mode`` trains in full (and a frozen-prefix cache must stop before):
    1 for ``last_block`` and ``head`` (whose cache stops before the last block, which then runs frozen), ``K`` for
    ``last_k:K``; ``None`` for the modes that train parameters of every block (``all``, ``bias``, ``lora``)."""
    check_trainable(mode)
    if mode in ("last_block", "head"):
        return 1
    if mode.startswith(_LAST_K):
        return int(mode[len(_LAST_K):])
    return None


@dataclass
class TrainableInfo:
    """What :func:`apply_trainable` selected.

    Attributes:
        mode: the trainable mode that was applied.
        trainable_names: names (as in ``model.named_parameters()`` of the
            returned model) of the parameters with ``requires_grad=True``.
        num_trainable: number of trainable scalar parameters.
        num_total: number of scalar parameters of the returned model (shared
            parameters counted once; for ``lora`` this includes the adapters and
            PEFT's trainable copies of the head).
        last_block: for ``last_block`` / ``last_k:K``, the qualified name of the
            first block module that was unfrozen (the last block for
            ``last_block``), else ``None``.
        suffix_blocks: :func:`suffix_blocks` of the mode: the number of trailing
            blocks a frozen-prefix cache stops before (``None``: no cache possible).
    """

    mode: str
    trainable_names: list[str] = field(default_factory=list)
    num_trainable: int = 0
    num_total: int = 0
    last_block: str | None = None
    suffix_blocks: int | None = None

    @property
    def fraction(self) -> float:
        return self.num_trainable / self.num_total if self.num_total else 0.0

    def summary(self) -> str:
        """One line, e.g. ``trainable 1,234 / 5,678 params (21.7%) [last_block]``."""
        return (
            f"trainable {self.num_trainable:,} / {self.num_total:,} params "
            f"({100.0 * self.fraction:.1f}%) [{self.mode}]"
        )


# --------------------------------------------------------------------------- helpers


def _base_model(model: nn.Module) -> nn.Module:
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def head_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters of ``model`` that are not parameters of ``model.base_model``."""
    base = _base_model(model)
    base_ids = {id(p) for p in base.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in base_ids]


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return ``(qualified_name, module_list)`` of the transformer blocks of ``model``.

    The blocks are the ``nn.ModuleList`` inside ``model.base_model`` with the
    largest parameter count among those whose children all have one class
    (ties go to the outermost list).  The name is relative to ``model``.
    """
    base = _base_model(model)
    base_prefix = next((n for n, m in model.named_modules() if m is base), "")
    best: tuple[str, nn.ModuleList] | None = None
    best_size = 0
    for name, module in base.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = _num_params(module)
        if size > best_size:  # strict: on ties keep the outer list (pre-order)
            best, best_size = (name, module), size
    if best is None:
        raise ValueError(
            f"Could not find the transformer blocks of {type(model).__name__}: no nn.ModuleList "
            "of same-class modules with parameters inside model.base_model; use --trainable all, "
            "head, bias or lora instead of last_block or last_k:K."
        )
    name = ".".join(x for x in (base_prefix, best[0]) if x)
    return name, best[1]


def _dummy_inputs(model: nn.Module) -> dict:
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        dummy = getattr(model, "dummy_inputs", None)
        if isinstance(dummy, dict):
            return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in dummy.items()}
        raise ValueError(f"Cannot build dummy inputs for {type(model).__name__} (no config.vocab_size).")
    pad = getattr(config, "pad_token_id", None)
    ids = [(i + 1) % vocab for i in range(16)]
    ids = [i for i in ids if i != pad][:8]
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _first_call_order(model: nn.Module) -> dict[int, int]:
    """Map ``id(module)`` -> index of its first call during one dummy forward."""
    order: dict[int, int] = {}

    def pre_hook(module, _args):
        order.setdefault(id(module), len(order))

    handles = [m.register_forward_pre_hook(pre_hook) for m in model.modules()]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(**_dummy_inputs(model))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return order


def _select_last_blocks(model: nn.Module, k: int = 1) -> tuple[set[int], str]:
    block_list_name, blocks = find_blocks(model)
    if not 1 <= k <= len(blocks):
        raise ValueError(
            f"--trainable last_k:{k}: {type(model).__name__} has {len(blocks)} blocks ({block_list_name}); "
            f"K must be between 1 and {len(blocks)} (last_k:{len(blocks)} trains every block, pooler and head; what runs before the first block stays frozen)."
        )
    first = blocks[len(blocks) - k]
    first_name = f"{block_list_name}.{len(blocks) - k}"
    order = _first_call_order(model)
    if any(id(b) not in order for b in list(blocks)[len(blocks) - k:]):
        raise ValueError(
            f"The block {first_name} of {type(model).__name__} was not called during a dummy "
            "forward pass; cannot determine what comes after it. Use another --trainable mode."
        )
    start = order[id(first)]
    selected = {id(p) for b in list(blocks)[len(blocks) - k:] for p in b.parameters()}
    for module in model.modules():
        if order.get(id(module), -1) > start:
            selected.update(id(p) for p in module.parameters(recurse=False))
    return selected, first_name


# Query/value projections for architectures that PEFT's default mapping
# (peft.utils.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) does not cover;
# same q/v convention as PEFT's entries for BERT-like models.
_EXTRA_LORA_TARGETS = {
    "distilbert": ["q_lin", "v_lin"],
    "albert": ["query", "value"],
    "mpnet": ["q", "v"],
}


def _default_lora_targets(model: nn.Module):
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in mapping:
        return None  # let PEFT fill in its own default
    if model_type in _EXTRA_LORA_TARGETS:
        return list(_EXTRA_LORA_TARGETS[model_type])
    return "all-linear"


def _is_causal_lm(model: nn.Module) -> bool:
    from hf_dp.models.loss import OBJECTIVES, objective_for

    return objective_for(model) is OBJECTIVES["causal_lm"]


def _vocabulary_parameters(model: nn.Module) -> set[int]:
    """The input and output embedding matrices of a causal LM (vocabulary × width; often one tied tensor)."""
    out = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, get, None)
        module = fn() if callable(fn) else None
        if isinstance(module, nn.Module):
            out.update(id(p) for p in module.parameters(recurse=False))
    return out


def _targets_are_conv1d(model: nn.Module, targets) -> bool:
    """Every module LoRA targets (by name suffix) is a transformers ``Conv1D`` (GPT-2's projections)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return False
    if targets is None:  # peft's own default for this model type
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

        targets = mapping.get(getattr(getattr(model, "config", None), "model_type", None))
    if not targets or isinstance(targets, str):
        return False
    names = set(targets)  # PEFT's matching: the module's name, or a dotted path it ends with
    hit = [m for name, m in model.named_modules() if any(name == t or name.endswith("." + t) for t in names)]
    return bool(hit) and all(isinstance(m, Conv1D) for m in hit)


def _apply_lora(model: nn.Module, lora_config) -> nn.Module:
    try:
        from peft import LoraConfig, PeftModel, TaskType, get_peft_model
    except ImportError as e:  # pragma: no cover
        raise ImportError("--trainable lora needs the `peft` package") from e

    if isinstance(model, PeftModel):
        raise ValueError("apply_trainable(..., 'lora') expects a plain transformers model, got a PeftModel.")
    causal = _is_causal_lm(model)  # the LM head is the (often tied) output embedding: adapters only, no head copy
    if lora_config is None:
        lora_config = {}
    if isinstance(lora_config, dict):
        kwargs = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, **lora_config}
        kwargs["task_type"] = TaskType.CAUSAL_LM if causal else TaskType.SEQ_CLS
        lora_config = LoraConfig(**kwargs)
    else:
        lora_config = copy.deepcopy(lora_config)
    if getattr(lora_config, "target_modules", None) is None and not getattr(lora_config, "target_parameters", None):
        lora_config.target_modules = _default_lora_targets(model)
    if getattr(lora_config, "modules_to_save", None) is None and not causal:
        # Top-level modules outside base_model that hold parameters = the head.
        base = _base_model(model)
        head = [
            name
            for name, child in model.named_children()
            if child is not base and any(True for _ in child.parameters())
        ]
        lora_config.modules_to_save = head or None
    if not getattr(lora_config, "fan_in_fan_out", False) and _targets_are_conv1d(model, lora_config.target_modules):
        lora_config.fan_in_fan_out = True  # GPT-2's Conv1D stores (in, out): what peft would set, with a warning
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated alias; nothing the user can change
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, lora_config)
    except ValueError as e:
        raise ValueError(
            f"PEFT could not build LoRA for {type(model).__name__} "
            f"(model_type={getattr(getattr(model, 'config', None), 'model_type', None)!r}): {e} "
            "Pass lora_config with explicit target_modules (--lora_target_modules)."
        ) from e
    problem = _lora_problem(peft_model, lora_config.target_modules)
    if problem:
        peft_model.unload()  # the caller's model as it was (its modules back in place)
        raise ValueError(problem)
    return peft_model


def _lora_problem(peft_model, targets) -> str | None:
    """Why these adapters cannot be trained and released as they are, in one sentence, or None: an adapter on an
    embedding (PEFT's embedding adapters index their parameters directly: no per-example gradient rule sees them); on a
    layer whose weight is the input embedding's (a tied LM head: merging the adapter into the release would change the
    embedding too, so the released model would not be the trained one); a named module that adapts nothing (PEFT skips
    a name that matches no module as long as another one matches)."""
    base = peft_model.get_base_model()
    adapted = {n: base.get_submodule(n) for n in peft_model.targeted_module_names}  # PEFT's own list of them
    embedded = sorted(n for n, m in adapted.items() if len(getattr(m, "lora_embedding_A", ())) > 0)
    if embedded:
        return (f"LoRA on an embedding ({', '.join(embedded)}) is not supported: its adapter parameters have no "
                "per-example gradient rule in hf_dp; let --lora_target_modules name linear layers only")
    emb = getattr(base.get_input_embeddings(), "weight", None)
    tied = sorted(n for n, m in adapted.items() if emb is not None and getattr(m.base_layer, "weight", None) is emb)
    if tied:
        return (f"LoRA on {', '.join(tied)}, whose weight is the input embedding's (tied weights), is not supported: "
                "merging the adapter into the release would change the embedding too, so the released model would not "
                "be the one trained; adapt other layers, or untie the weights (tie_word_embeddings=False)")
    if isinstance(targets, (list, tuple, set)):
        missing = sorted(t for t in targets if not any(n == t or n.endswith("." + t) for n in adapted))
        if missing:
            return (f"--lora_target_modules {' '.join(missing)}: no such module of this model took an adapter (PEFT "
                    "skips such a name while another matches); name modules the model has")
    return None


# --------------------------------------------------------------------------- public API


def apply_trainable(
    model: nn.Module, trainable: str = "last_block", lora_config=None
) -> tuple[nn.Module, TrainableInfo]:
    """Freeze ``model`` except for the parameters selected by ``trainable``.

    Args:
        model: a transformers ``PreTrainedModel`` (typically ``*ForSequenceClassification``).
            Modified in place (``requires_grad`` flags; for ``lora`` PEFT also
            injects adapter layers into it).
        trainable: one of :data:`TRAINABLE_MODES` (``last_k:2`` etc.; see the module docstring).
        lora_config: only for ``lora``: a ``peft.LoraConfig`` (used as is, except
            that ``modules_to_save`` defaults to the head modules when unset), a
            dict of ``LoraConfig`` keyword arguments (defaults ``r=8,
            lora_alpha=16, lora_dropout=0.0``; ``task_type`` is forced to
            ``SEQ_CLS``, ``CAUSAL_LM`` for a causal LM) or ``None`` (all defaults).

    Returns:
        ``(model, info)``: the model to train (the ``PeftModel`` for ``lora``,
        else the same object) and a :class:`TrainableInfo`.

    Raises:
        ValueError: unknown mode, ``lora_config`` given for another mode, the
            blocks cannot be found, or the mode selects no parameter (for the
            non-LoRA modes this is raised before any flag is changed).
    """
    check_trainable(trainable)
    if lora_config is not None and trainable != "lora":
        raise ValueError(f"lora_config is only used with trainable='lora', not {trainable!r}.")

    last_block_name = None
    if trainable == "lora":
        model = _apply_lora(model, lora_config)
    else:
        if trainable == "all":
            selected = {id(p) for p in model.parameters()}
        elif trainable == "head":
            head = set(head_parameter_names(model))
            selected = {id(p) for n, p in model.named_parameters() if n in head}
        elif trainable == "bias":
            head = set(head_parameter_names(model))
            selected = {id(p) for n, p in model.named_parameters() if n in head}
            for module in model.modules():
                bias = module._parameters.get("bias")
                if isinstance(bias, nn.Parameter):
                    selected.add(id(bias))
        else:  # last_block, last_k:K
            selected, last_block_name = _select_last_blocks(model, suffix_blocks(trainable))
            if _is_causal_lm(model):  # the final norm, not the vocabulary matrices (tied: the input embedding too)
                selected -= _vocabulary_parameters(model)
        if not selected:
            raise ValueError(
                f"trainable={trainable!r} selects no parameter of {type(model).__name__}; "
                "choose another mode (e.g. last_block or all)."
            )
        for p in model.parameters():
            p.requires_grad_(id(p) in selected)

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:  # only reachable for a LoRA config that trains nothing
        raise ValueError(f"trainable={trainable!r} selects no parameter of {type(model).__name__}.")
    info = TrainableInfo(
        mode=trainable,
        trainable_names=names,
        num_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        num_total=sum(p.numel() for p in model.parameters()),
        last_block=last_block_name,
        suffix_blocks=suffix_blocks(trainable),
    )
    return model, info
