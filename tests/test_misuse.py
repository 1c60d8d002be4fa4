"""Every row of docs/misuse.md: the misuse fails before any training step, with the documented
exception type and message (one sentence).

Each case builds DPTrainingArguments, then DPTrainer, then calls ``train()``; the exception may come
from any of the three, but no optimizer step may have happened (a callback counts them) and the
model's parameters must be untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.filterwarnings("ignore")

N = 64


def _cfg():
    from transformers import BertConfig

    return BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=32, num_labels=2)


def bert():
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(_cfg())


def gpt2_tied():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32, tie_word_embeddings=True))


def bert_with_batchnorm():
    model = bert()
    model.classifier = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 2))
    return model


def bert_without_head():
    from transformers import BertModel

    torch.manual_seed(0)
    return BertModel(_cfg())


def dataset(n=N, labels=True):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (n, 8), generator=g)
    cols = {"input_ids": ids.tolist(), "attention_mask": [[1] * 8] * n}
    if labels:
        cols["labels"] = (ids[:, 0] > 27).long().tolist() if n else []
    return Dataset.from_dict(cols)


def bert_regression():
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(_cfg().__class__(**{**_cfg().to_dict(), "num_labels": 1}))


def bert_masked_lm():
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(_cfg())


def dataset_with_label(value, at=7):
    data = dataset()
    labels = [float(v) for v in data["labels"]] if isinstance(value, float) else list(data["labels"])
    labels[at] = value
    return data.remove_columns("labels").add_column("labels", labels)


def two_rows_per_example(features):
    from transformers import default_data_collator

    return default_data_collator(list(features) * 2)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(N):
            yield {"input_ids": [5 + i % 40] * 8, "attention_mask": [1] * 8, "labels": i % 2}


BASE = dict(optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, delta=1e-3,
            per_device_train_batch_size=8, max_steps=4, report_to=[], use_cpu=True, disable_tqdm=True,
            save_strategy="no", dp_seed=0, trainable="all")

EVAL_IS_TRAIN = (r"^the eval dataset is \(or overlaps\) the private training set, so its metrics and any model selection or "
                 r"early stopping on them would publish non-private statistics of the training data; evaluate on held-out data$")


def _eval_set(kind, train):
    """The eval_dataset sentinels of CASES, built from the train dataset object of the case."""
    import copy

    if kind == "train":
        return train
    if kind == "train-copy":  # another object with the same 🤗 Datasets fingerprint
        return copy.deepcopy(train)
    if kind == "dict-with-train":
        return {"heldout": dataset(16), "train": train}
    if kind == "subset-of-train":
        return torch.utils.data.Subset(train, range(16))
    raise KeyError(kind)


# id: (args overrides (a callable value gets the output_dir), train dataset factory, model factory, extra DPTrainer kwargs, exception, message regex)
# keep in sync with docs/misuse.md (test_doc_table_lists_every_case checks the ids)
FSDP = {"fsdp": "full_shard"}

CASES = {
    "epsilon-zero": ({"epsilon": 0.0, "noise_multiplier": None}, dataset, bert, {},
                     ValueError, r"^epsilon must be a finite number > 0, got 0\.0$"),
    "epsilon-negative": ({"epsilon": -1.0, "noise_multiplier": None}, dataset, bert, {},
                         ValueError, r"^epsilon must be a finite number > 0, got -1\.0$"),
    "epsilon-nan": ({"epsilon": math.nan, "noise_multiplier": None}, dataset, bert, {},
                    ValueError, r"^epsilon must be a finite number > 0, got nan$"),
    "delta-zero": ({"delta": 0.0}, dataset, bert, {},
                   ValueError, r"^delta must be a number in \(0, 1\), got 0\.0$"),
    "delta-at-least-1/N": ({"delta": 1 / N}, dataset, bert, {},
                           ValueError, r"^delta=0\.015625 is not below 1/N = 1/64 = 0\.0156: such a delta allows a mechanism that publishes a whole training example"),
    "clip-norm-zero": ({"per_sample_max_grad_norm": 0.0}, dataset, bert, {},
                       ValueError, r"^--per_sample_max_grad_norm \(C\) must be a finite number > 0, got 0\.0$"),
    "sigma-negative": ({"noise_multiplier": -0.5}, dataset, bert, {},
                       ValueError, r"^--noise_multiplier must be a finite number > 0 \(sigma = 0 is not private\), got -0\.5$"),
    "sigma-zero": ({"noise_multiplier": 0.0}, dataset, bert, {},
                   ValueError, r"^--noise_multiplier must be a finite number > 0 \(sigma = 0 is not private\), got 0\.0$"),
    "epsilon-and-sigma": ({"epsilon": 3.0, "noise_multiplier": 1.0}, dataset, bert, {},
                          ValueError, r"^give exactly one of --epsilon \(target\) and --noise_multiplier \(sigma\)$"),
    "neither-epsilon-nor-sigma": ({"noise_multiplier": None}, dataset, bert, {},
                                  ValueError, r"^give exactly one of --epsilon \(target\) and --noise_multiplier \(sigma\)$"),
    "batch-larger-than-dataset": ({"per_device_train_batch_size": 128}, dataset, bert, {},
                                  ValueError, r"^the expected logical batch B = .* = 128 is larger than the dataset \(N = 64\); Poisson sampling needs q = B/N ≤ 1$"),
    "accumulation-makes-batch-larger-than-dataset": ({"gradient_accumulation_steps": 16}, dataset, bert, {},
                                                     ValueError, r"^the expected logical batch B = .* = 128 is larger than the dataset \(N = 64\)"),
    "accumulation-with-iterable-dataset": ({"gradient_accumulation_steps": 2}, Stream, bert, {},
                                           ValueError, r"^DP training needs a sized train_dataset \(an IterableDataset cannot be Poisson-sampled\)$"),
    "empty-dataset": ({}, lambda: dataset(0), bert, {},
                      ValueError, r"^the training dataset is empty$"),
    "no-train-dataset": ({}, lambda: None, bert, {},
                         ValueError, r"^DP training needs a train_dataset \(its size N defines q and delta < 1/N\)$"),
    "missing-label-column": ({}, lambda: dataset(labels=False), bert, {},
                             ValueError, r"^the train dataset has no label column \('labels' or 'label'; it has \['attention_mask', 'input_ids'\]\): DP training computes each example's loss from its label$"),
    "budget-unreachable": ({"epsilon": 1e-6, "noise_multiplier": None, "max_steps": 1000}, dataset, bert, {},
                           ValueError, r"^cannot reach epsilon=1e-06 at delta=0\.001 with q=0\.125 over 1000 steps: The privacy budget is too low\.$"),
    "epsilon-above-ceiling": ({"epsilon": 1e6, "noise_multiplier": None}, dataset, bert, {},
                              ValueError, r"^--epsilon 1e\+06 is above hf_dp's ceiling of 50: such a guarantee bounds nothing \(e\^epsilon\), and calibrating sigma for it takes minutes; use --epsilon <= 50, or --disable_dp for a non-private baseline$"),
    "batch-size-zero": ({"per_device_train_batch_size": 0}, dataset, bert, {},
                        ValueError, r"^--per_device_train_batch_size must be a whole number >= 1 under DP, got 0$"),
    "label-nan": ({}, lambda: dataset_with_label(math.nan), bert_regression, {},
                  ValueError, r"^the training labels \(column 'labels'\) contain NaN or infinite values \(first at row 7, counting from 0\): such an example's loss and gradient are not finite; remove or fix those rows before DP training$"),
    "label-out-of-range": ({}, lambda: dataset_with_label(5), bert, {},
                           ValueError, r"^the training labels \(column 'labels'\) contain 5 \(first at row 7, counting from 0\), outside the model's classes 0\.\.1: the step that draws that example would fail; fix the labels or the model's num_labels before DP training$"),
    "unsupported-head": ({}, dataset, bert_masked_lm, {},
                         ValueError, r"^BertForMaskedLM is a masked language model, but DPTrainer computes each example's loss only for the heads it supports \(sequence_classification, causal_lm: \*ForSequenceClassification, \*ForCausalLM\), so it would train this model on the wrong objective; use a supported head \(other heads are not supported yet\)$"),
    "privacy-unit-column-missing": ({"privacy_unit_column": "user_id"}, dataset, bert, {},
                                    ValueError, r"^--privacy_unit_column user_id: the training set has no column 'user_id' \(it has \['attention_mask', 'input_ids', 'labels'\]\)$"),
    "max-rows-per-unit-without-unit": ({"max_rows_per_unit": 2}, dataset, bert, {},
                                       ValueError, r"^--max_rows_per_unit needs --privacy_unit_column \(without it every unit is one row\)$"),
    "public-dataset-size-not-positive": ({"public_dataset_size": 0}, dataset, bert, {},
                                         ValueError, r"^--public_dataset_size must be a whole number >= 1 \(the number of training examples, or of units with --privacy_unit_column, declared public\), got 0$"),
    "collator-two-rows-per-example": ({}, dataset, bert, {"data_collator": two_rows_per_example},
                                      ValueError, r"^the data collator returned '\w+' with \d+ rows for \d+ drawn example\(s\): DP training needs exactly one row per example"),
    "max-steps-zero": ({"max_steps": 0}, dataset, bert, {},
                       ValueError, r"^--max_steps 0 trains nothing$"),
    "tokens_seen": ({"include_num_input_tokens_seen": True}, dataset, bert, {},
                    ValueError, r"^--include_num_input_tokens_seen logs how many tokens the Poisson-sampled batches held, .*not allowed with DP$"),
    "fp16": ({"fp16": True}, dataset, bert, {},
             ValueError, r"^--fp16 is not supported with DP: dynamic loss scaling skips steps depending on private gradients; train in float32$"),
    "macadam-beta1-zero": ({"optim": "dp_macadam", "adam_beta1": 0.0}, dataset, bert, {},
                           ValueError, r"^DP-MacAdam needs betas\[0\] \(--adam_beta1\) > 0: its bound refresh divides by κ_t ∝ β1 − β1\^t; got 0\.0$"),
    "bf16": ({"bf16": True}, dataset, bert, {},
             ValueError, r"^--bf16 is not supported with DP training: under bf16 autocast each example's gradient depends on the padded length and shape of its micro-batch"),
    "bf16-weights": ({}, dataset, lambda: bert().to(torch.bfloat16), {},
                     ValueError, r"^DP training needs the model in float32 \(or float64\), got bfloat16 weights \(such as \S+, frozen or not\): in reduced precision"),
    "bf16-frozen-base": ({"trainable": "lora"}, dataset, lambda: bert().to(torch.bfloat16), {},
                         ValueError, r"^DP training needs the model in float32 \(or float64\), got bfloat16 weights \(such as \S+, frozen or not\): in reduced precision"),
    "fsdp-one-process": (FSDP, dataset, bert, {},
                         ValueError, r"^--fsdp needs several processes \(torchrun --nproc_per_node 2 \.\.\. or accelerate launch, on CPU with --ddp_backend gloo --use_cpu\); in one process train without --fsdp$"),
    "fsdp-config": ({"fsdp_config": {"version": 2}}, dataset, bert, {},
                    ValueError, r"^--fsdp_config without --fsdp is not allowed with DP: HF ignores it and trains with DDP; add --fsdp full_shard \(or drop --fsdp_config\)$"),
    "fsdp-version-1": ({**FSDP, "fsdp_config": {"version": 1}}, dataset, bert, {},
                       ValueError, r"^DP under FSDP needs FSDP2 \(fsdp_config version 2, the default\); FSDP1 is not supported$"),
    "fsdp-clipping-hooks": ({**FSDP, "clipping": "hooks"}, dataset, bert, {},
                            ValueError, r"^--clipping hooks is not supported under FSDP: only ghost clipping keeps the gradients sharded"),
    "fsdp-bf16": ({**FSDP, "bf16": True}, dataset, bert, {},
                  ValueError, r"^--bf16 is not supported with DP training"),
    "fsdp-cache-frozen-features": ({**FSDP, "trainable": "last_block", "cache_frozen_features": True}, dataset, bert, {},
                                   ValueError, r"^--cache_frozen_features is not supported under FSDP: the prefix cache is built with the full model on one rank"),
    "fsdp-affine-rule": ({**FSDP, "optim": "dp_sgd_l2"}, dataset, bert, {},
                         ValueError, r"^--optim dp_sgd_l2 is not supported under FSDP: its per-sample affine map needs every layer's full offset and scale"),
    "fsdp-tied-weights": (FSDP, dataset, gpt2_tied, {},
                          ValueError, r"^the trainable parameter transformer\.wte\.weight is shared with lm_head\.weight \(tied weights\), which DP under FSDP does not support"),
    "trainable-batchnorm": ({}, dataset, bert_with_batchnorm, {},
                            ValueError, r"^Cannot compute per-sample gradients for this model: classifier\.0 \(BatchNorm1d\) is trainable, but BatchNorm mixes the examples of a batch, so per-example gradients \(and DP\) are undefined; freeze it or replace it by GroupNorm/LayerNorm\.$"),
    "trainable-selects-nothing": ({"trainable": "head"}, dataset, bert_without_head, {},
                                  ValueError, r"^trainable='head' selects no parameter of BertModel; choose another mode \(e\.g\. last_block or all\)\.$"),
    "unknown-optimizer": ({"optim": "dp_adagrad"}, dataset, bert, {},
                          ValueError, r"^--optim dp_adagrad is not a DP optimizer: choose one of dp_.*, or pass --disable_dp explicitly for a non-private baseline$"),
    "hf-optimizer-without-disable-dp": ({"optim": "adamw_torch"}, dataset, bert, {},
                                        ValueError, r"^--optim adamw_torch is not a DP optimizer: choose one of dp_.*, or pass --disable_dp explicitly"),
    "dp-optimizer-with-disable-dp": ({"disable_dp": True}, dataset, bert, {},
                                     ValueError, r"^--optim dp_adamw is a DP optimizer but --disable_dp was given; for a non-private baseline use an HF optimizer such as adamw_torch$"),
    "own-optimizer-passed": ({}, dataset, bert, {"optimizers": "sgd"},
                             ValueError, r"^DPTrainer builds its own DP optimizer from --optim; do not pass optimizers=$"),
    "model-init": ({}, dataset, lambda: None, {"model_init": bert},
                   ValueError, r"^DPTrainer needs a model \(model_init is not supported with DP\)$"),
    "unknown-trainable-mode": ({"trainable": "decoder"}, dataset, bert, {},
                               ValueError, r"^--trainable must be one of last_block, last_k:K, head, all, bias, lora \(K = 1, 2, \.\.\.\), got 'decoder'$"),
    "lora-targets-without-lora": ({"lora_target_modules": ["c_fc"]}, dataset, bert, {},
                                  ValueError, r"^--lora_target_modules needs --trainable lora \(it names the modules LoRA adapts\), got --trainable all$"),
    "lora-targets-all-linear-not-alone": ({"trainable": "lora", "lora_target_modules": ["all-linear", "query"]}, dataset, bert, {},
                                          ValueError, r"^--lora_target_modules all-linear stands alone, got \['all-linear', 'query'\]$"),
    "lora-on-an-embedding": ({"trainable": "lora", "lora_target_modules": ["word_embeddings"]}, dataset, bert, {},
                             ValueError, r"^LoRA on an embedding \(bert\.embeddings\.word_embeddings\) is not supported: its adapter parameters have no per-example gradient rule in hf_dp; let --lora_target_modules name linear layers only$"),
    "lora-on-a-tied-lm-head": ({"trainable": "lora", "lora_target_modules": ["c_attn", "lm_head"]}, dataset, gpt2_tied, {},
                               ValueError, r"^LoRA on lm_head, whose weight is the input embedding's \(tied weights\), is not supported: merging the adapter into the release would change the embedding too, so the released model would not be the one trained; adapt other layers, or untie the weights \(tie_word_embeddings=False\)$"),
    "lora-target-matches-nothing": ({"trainable": "lora", "lora_target_modules": ["query", "valeu"]}, dataset, bert, {},
                                    ValueError, r"^--lora_target_modules valeu: no such module of this model took an adapter \(PEFT skips such a name while another matches\); name modules the model has$"),
    "trainable-last-k-not-a-number": ({"trainable": "last_k:two"}, dataset, bert, {},
                                      ValueError, r"^--trainable last_k:two: K in last_k:K must be a whole number >= 1 \(e\.g\. last_k:2\), got 'two'$"),
    "trainable-last-k-too-deep": ({"trainable": "last_k:9"}, dataset, bert, {},
                                  ValueError, r"^--trainable last_k:9: BertForSequenceClassification has 2 blocks \(bert\.encoder\.layer\); K must be between 1 and 2"),
    "unknown-accountant": ({"accountant": "gdp"}, dataset, bert, {},
                           ValueError, r"^--accountant must be one of \('prv', 'rdp'\), got 'gdp'$"),
    # HF flags refused under DP by the registry hf_dp/flags.py (docs/privacy_flags.md)
    "auto-find-batch-size": ({"auto_find_batch_size": True}, dataset, bert, {},
                             ValueError, r"^--auto_find_batch_size is not supported with DP: after an out-of-memory error it restarts training with a smaller batch, so the steps already taken and q = B/N would no longer be what the accountant describes"),
    "train-sampling-sequential": ({"train_sampling_strategy": "sequential"}, dataset, bert, {},
                                  ValueError, r"^--train_sampling_strategy sequential or batch_rebalance is not allowed with DP: DPTrainer draws every batch by Poisson sampling at rate q = B/N, as the accountant assumes, so HF's sampler choice would be silently ignored$"),
    "train-sampling-batch-rebalance": ({"train_sampling_strategy": "batch_rebalance"}, dataset, bert, {},
                                       ValueError, r"^--train_sampling_strategy sequential or batch_rebalance is not allowed with DP"),
    "label-smoothing": ({"label_smoothing_factor": 0.1}, dataset, bert, {},
                        ValueError, r"^--label_smoothing_factor is not supported with DP: DPTrainer computes each example's loss itself, without label smoothing, so it would be silently ignored in training$"),
    "label-names": ({"label_names": ["start_positions", "end_positions"]}, dataset, bert, {},
                    ValueError, r"^--label_names other than labels is not supported with DP: DPTrainer computes each example's loss from the 'labels' column$"),
    "neftune": ({"neftune_noise_alpha": 5.0}, dataset, bert, {},
                ValueError, r"^--neftune_noise_alpha is not supported with DP: NEFTune scales its embedding noise by the padded length of the whole batch, so one example changes the other examples' gradients and the per-example bound C no longer holds"),
    "torch-compile": ({"torch_compile": True}, dataset, bert, {},
                      ValueError, r"^--torch_compile is not supported with DP: hf_dp's per-example clipping records activations and gradients through module hooks, which torch\.compile has not been verified to preserve"),
    "torch-compile-mode": ({"torch_compile_mode": "reduce-overhead"}, dataset, bert, {},
                           ValueError, r"^--torch_compile_mode turns on torch\.compile, which is not supported with DP"),
    "activation-checkpointing": ({"activation_checkpointing": True}, dataset, bert, {},
                                 ValueError, r"^--activation_checkpointing \(--gradient_checkpointing\) is not supported with DP: hf_dp's per-example clipping records activations and gradients through module hooks, and the forward recomputed during backward would run them again"),
    "gradient-checkpointing": ({"gradient_checkpointing": True}, dataset, bert, {},
                               ValueError, r"^--gradient_checkpointing \(--activation_checkpointing\) is not supported with DP"),
    "cache-bf16-full-eval": ({"cache_frozen_features": True, "bf16_full_eval": True}, dataset, bert, {},
                             ValueError, r"^--bf16_full_eval with --cache_frozen_features: HF's evaluate\(\) casts the whole model, frozen prefix included, to half precision and leaves it so, after which the cached features are no longer this model's \(evaluation runs only the trainable suffix on them anyway\); use --bf16 \(mixed precision, the weights stay float32\), or drop one of the two flags$"),
    "liger-kernel": ({"use_liger_kernel": True}, dataset, bert, {},
                     ValueError, r"^--use_liger_kernel is not supported with DP: Liger replaces model layers and the loss by fused kernels that hf_dp's per-example clipping does not know$"),
    "optim-target-modules": ({"optim_target_modules": ["attn"]}, dataset, bert, {},
                             ValueError, r"^--optim_target_modules selects the modules of GaLore/APOLLO optimizers, which are not DP update rules, so it would be silently ignored"),
    "parallelism-config": ({"parallelism_config": {"tp_size": 2}}, dataset, bert, {},
                           ValueError, r"^--parallelism_config is not supported with DP: tensor, context, sequence or sharded parallelism splits each example's computation across processes"),
    "hub-strategy-checkpoint": ({"hub_strategy": "checkpoint"}, dataset, bert, {},
                                ValueError, r"^--hub_strategy checkpoint/all_checkpoints is not allowed with DP: it uploads checkpoint folders, whose trainer_state\.json logs the non-private training loss and whose optimizer and RNG state are not part of the DP release; use --hub_strategy every_save or end$"),
    "hub-strategy-all-checkpoints": ({"hub_strategy": "all_checkpoints"}, dataset, bert, {},
                                     ValueError, r"^--hub_strategy checkpoint/all_checkpoints is not allowed with DP"),
    "tensorboard-pushed": ({"report_to": ["tensorboard"], "push_to_hub": True, "hub_model_id": "me/model"}, dataset, bert, {},
                           ValueError, r"^--report_to tensorboard with --push_to_hub is not allowed with DP: TensorBoard writes the non-private training loss under output_dir/runs, which push_to_hub uploads with the model"),
    "trackio-synced": ({"report_to": ["trackio"], "push_to_hub": True}, dataset, bert, {},
                       ValueError, r"^--report_to trackio with --push_to_hub is not allowed with DP: every push syncs the Trackio logs, with the non-private training loss, to a Hub Space"),
    "jit-checkpoint": ({"enable_jit_checkpoint": True}, dataset, bert, {},
                       ValueError, r"^--enable_jit_checkpoint is not supported with DP: HF writes its SIGTERM checkpoint next to an in-progress sentinel file"),
    "debug-underflow-overflow": ({"debug": "underflow_overflow"}, dataset, bert, {},
                                 ValueError, r"^--debug underflow_overflow is not allowed with DP: it prints activation statistics of the private batch and stops training when one overflows"),
    "data-seed": ({"data_seed": 3}, dataset, bert, {},
                  ValueError, r"^--data_seed seeds HF's train sampler, which DP's Poisson sampling replaces, so it would be silently ignored; use --dp_seed"),
    "memory-metrics": ({"skip_memory_metrics": False}, dataset, bert, {},
                       ValueError, r"^--skip_memory_metrics False is not allowed with DP: the logged peak memory of training grows with the largest Poisson batch and its padded length"),
    "secure-rng-with-dp-seed": ({"secure_rng": True}, dataset, bert, {},
                                ValueError, r"^--secure_rng draws from the OS CSPRNG and cannot be seeded: drop --dp_seed \(or --secure_rng\)$"),
    "eval-is-train-set": ({}, dataset, bert, {"eval_dataset": "train"}, ValueError, EVAL_IS_TRAIN),
    "eval-same-fingerprint-as-train": ({}, dataset, bert, {"eval_dataset": "train-copy"}, ValueError, EVAL_IS_TRAIN),
    "eval-dict-contains-train-set": ({}, dataset, bert, {"eval_dataset": "dict-with-train"}, ValueError, EVAL_IS_TRAIN),
    "eval-subset-of-train-set": ({}, dataset, bert, {"eval_dataset": "subset-of-train"}, ValueError, EVAL_IS_TRAIN),
    "cache-dir-inside-output-dir": ({"trainable": "last_block", "cache_frozen_features": True,
                                     "cache_frozen_features_dir": lambda out: f"{out}/cache"}, dataset, bert, {},
                                    ValueError, r"^--cache_frozen_features_dir \S+/cache is inside --output_dir \S+, whose files are saved and pushed with the model, and the cache holds the hidden states of every training example; use a folder outside output_dir \(or, with --keep_frozen_features_cache, output_dir itself or a subfolder whose name starts with '_', which pushes skip\)$"),
    "audit-canaries-too-few": ({"audit_canaries": 50, "delta": 1e-5}, dataset, bert, {},
                               ValueError, r"^--audit_canaries must be a whole number >= 100 \(fewer canaries cannot refute any useful epsilon\), got 50$"),
    "audit-canaries-delta-too-large": ({"audit_canaries": 100}, dataset, bert, {},
                                       ValueError, r"^--audit_canaries 100 with --delta 0\.001: 2\*m\*delta = 0\.2 >= 0\.05, so the one-run bound can certify nothing; use fewer canaries or a smaller delta$"),
    "audit-canaries-disable-dp": ({"audit_canaries": 100, "disable_dp": True, "optim": "adamw_torch", "noise_multiplier": None},
                                  dataset, bert, {}, ValueError,
                                  r"^--audit_canaries audits a DP run; a --disable_dp baseline has no epsilon to bound$"),
    "audit-canaries-kept-cache": ({"audit_canaries": 100, "delta": 1e-5, "trainable": "last_block", "cache_frozen_features": True,
                                   "keep_frozen_features_cache": True, "cache_frozen_features_dir": lambda out: f"{out}/_cache"},
                                  dataset, bert, {}, ValueError,
                                  r"^--audit_canaries with --keep_frozen_features_cache: the kept cache of the training set would hold the included canaries' features, i\.e\. the secret draw; drop --keep_frozen_features_cache$"),
    "audit-canaries-regression": ({"audit_canaries": 100, "delta": 1e-5}, dataset, bert_regression, {},
                                  ValueError, r"^--audit_canaries supports single-label sequence classifiers \(>= 2 labels\) and causal LMs only: its black-box canaries are random token sequences, with random labels for a classifier$"),
    "audit-kind-unknown": ({"audit_canaries": 100, "delta": 1e-5, "audit_kind": "weights"}, dataset, bert, {},
                           ValueError, r"^--audit_kind must be one of input, gradient, got 'weights'$"),
    "audit-gradient-fsdp": ({**FSDP, "audit_canaries": 100, "delta": 1e-5, "audit_kind": "gradient"}, dataset, bert, {},
                            ValueError, r"^--audit_kind gradient is not supported with --fsdp: the canaries' gradients would be added to sharded sums; use --audit_kind input$"),
    "audit-gradient-per-sample-transform": ({"audit_canaries": 100, "delta": 1e-5, "audit_kind": "gradient", "optim": "dp_sgd_l2", "audit_canary_length": 8,
                                             "weight_decay": 0.1}, dataset, bert, {},
                                            ValueError, r"^--audit_kind gradient needs an update rule without a per-sample transform of the gradients \(DPSGDL2 has one: a canary row's zero gradient would still add its offset\); use --audit_kind input, or dp_sgd / dp_adam / dp_adamw / dp_adambc / dp_adamw_bc$"),
}


def test_deepspeed_is_refused_by_the_trainer(tmp_path):
    """Row `deepspeed` of docs/misuse.md. HF's arguments import deepspeed (not installed here) when it is given, so
    the trainer's own refusal is checked with ``args.deepspeed`` set after the arguments were built."""
    from hf_dp import DPTrainer, DPTrainingArguments

    args = DPTrainingArguments(**{**BASE, "output_dir": str(tmp_path)})
    args.deepspeed = {"train_micro_batch_size_per_gpu": 8}
    with pytest.raises(ValueError) as info:
        DPTrainer(model=bert(), args=args, train_dataset=dataset())
    assert info.match(r"^--deepspeed is not supported with DP: DeepSpeed's engine runs the backward, the gradient reduction, "
                      r"the loss scaling and the optimizer step itself, bypassing hf_dp's per-example clipping and noise; "), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", list(CASES))
def test_misuse_fails_before_training(case, tmp_path):
    from transformers import TrainerCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    overrides, make_data, make_model, trainer_kw, exc, pattern = CASES[case]

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_begin(self, args, state, control, **kw):
            CountSteps.steps += 1

        def on_optimizer_step(self, args, state, control, **kw):
            CountSteps.steps += 1

    model = make_model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()} if model is not None else {}
    trainer_kw = dict(trainer_kw)
    if trainer_kw.get("optimizers") == "sgd":
        trainer_kw["optimizers"] = (torch.optim.SGD(model.parameters(), lr=0.1), None)
    kw = {**BASE, "output_dir": str(tmp_path), **overrides}
    kw = {k: (v(str(tmp_path)) if callable(v) else v) for k, v in kw.items()}
    train = make_data()
    if isinstance(trainer_kw.get("eval_dataset"), str):
        trainer_kw["eval_dataset"] = _eval_set(trainer_kw["eval_dataset"], train)
    with pytest.raises(exc) as info:
        args = DPTrainingArguments(**kw)
        trainer = DPTrainer(model=model, args=args, train_dataset=train, callbacks=[CountSteps()], **trainer_kw)
        trainer.train()
    message = str(info.value)
    assert info.match(pattern), message
    assert "\n" not in message
    assert CountSteps.steps == 0
    if model is not None:
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "a parameter changed"


def test_doc_table_lists_every_case():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "misuse.md").read_text()
    missing = [case for case in CASES if f"`{case}`" not in doc]
    assert not missing, f"docs/misuse.md does not document {missing}"
    assert len(CASES) >= 15


# ------------------------------------------------------------- private selection (docs/misuse.md, `search-*` rows)
SEARCH_SPACE = {"learning_rate": [1e-3, 1e-2]}
SEARCH_CASES = {
    # id: (args overrides, hyperparameter_search overrides, message regex)
    "search-space-empty": ({}, {"hp_space": {}}, r"^the search space is empty"),
    "search-space-mechanism-flag": ({}, {"hp_space": {"num_train_epochs": [1, 2]}},
                                    r"^the search space may not hold --num_train_epochs: it defines the mechanism"),
    "search-adaptive-backend": ({}, {"backend": "optuna"},
                                r"^under DP hyperparameter_search runs backend='dp_random_stopping' only"),
    "search-score-undeclared": ({}, {"score_data": None}, r"^declare what the trials are scored on: score_data='public'"),
    "search-score-private-objective": ({}, {"score_data": "private", "direction": "maximize",
                                            "compute_objective": lambda metrics: metrics["eval_loss"]},
                                       r"^under score_data='private' a trial's score is the DP mean of example_score"),
    "search-score-private-direction": ({}, {"score_data": "private"},
                                       r"^the default DP score is the accuracy \(higher is better\)"),
    "search-score-noise-too-small": ({}, {"score_data": "private", "direction": "maximize", "score_noise_multiplier": 0.3},
                                     r"^score_noise_multiplier=0.3: the DP scores alone would spend epsilon .*more than half"),
    "search-without-model-init": ({}, {"model_init": None}, r"^hyperparameter_search needs model_init="),
    "search-with-sigma": ({"epsilon": None, "noise_multiplier": 1.0}, {},
                          r"^private selection calibrates each trial's sigma for the total: give --epsilon"),
}


@pytest.mark.parametrize("case", list(SEARCH_CASES))
def test_private_selection_misuse_is_refused_before_any_trial(case, tmp_path):
    from hf_dp import DPTrainer, DPTrainingArguments

    overrides, search_kw, pattern = SEARCH_CASES[case]
    built = []

    def model_init():
        built.append(bert())
        return built[-1]

    kw = {**BASE, "output_dir": str(tmp_path), "epsilon": 3.0, "noise_multiplier": None, "per_device_train_batch_size": N,
          **overrides}  # q = 1: the accountant answers in milliseconds
    trainer = DPTrainer(model=bert(), args=DPTrainingArguments(**kw), train_dataset=dataset(), eval_dataset=dataset(16))
    search = {**dict(hp_space=SEARCH_SPACE, n_trials=2, direction="minimize", backend="dp_random_stopping",
                     model_init=model_init, score_data="public"), **search_kw}
    with pytest.raises(ValueError) as info:
        trainer.hyperparameter_search(**search)
    assert info.match(pattern), str(info.value)
    assert "\n" not in str(info.value) and built == [] and trainer.state.global_step == 0


def test_doc_lists_every_private_selection_case():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "misuse.md").read_text()
    assert not [case for case in SEARCH_CASES if f"`{case}`" not in doc]
