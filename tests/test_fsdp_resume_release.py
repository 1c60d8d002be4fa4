"""Under FSDP (one 2-process gloo launch, ``--fsdp full_shard``, tiny BERT, ``--dp_seed``, the noise on):

* two resumes from checkpoints of one run draw different noise: U trains 4 steps (checkpoints 2 and 4); R2 resumes
  checkpoint-2 (its ledger counts U's 2 steps past it, so its first step is ledger step 4), R4 resumes checkpoint-4
  (ledger step 4 too). Before the fix both keyed the FSDP noise of each (parameter, shard) by the ledger step alone and
  drew the same noise (the difference of the two models' updates noise-free); now R2, not a clean continuation, keys
  its streams by an id of its own (hf_dp.run.spent.reconcile_resumed_ledger);
* ``save_model()`` into a folder whose name starts with ``checkpoint-`` is a release like any other: it writes the
  gathered model's weights (before the fix it took the folder's name for a checkpoint and wrote no weights, only the
  config, the card and privacy.json). A checkpoint is what ``DPTrainer._save_checkpoint`` writes, not a name.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, launch, rank_results  # noqa: E402

WORKER = r"""
    from hf_dp import DPTrainer
    from hf_dp.privacy.privatizer import PrivateOptimizer, _local
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    ds = make_pair_dataset(tok, n=16)
    noises = []
    original = PrivateOptimizer._add_shard_noise

    def spy(self, std):  # the noise this rank added to its shards at this step
        before = [_local(p.summed_grad).clone() for p in self.params]
        result = original(self, std)
        noises.append(torch.cat([(_local(p.grad) - b).reshape(-1) for p, b in zip(self.params, before)]))
        return result

    PrivateOptimizer._add_shard_noise = spy

    def run(name, max_steps, resume=None):
        del noises[:]
        args = dp_args(os.path.join(out, name), optim="dp_adamw", learning_rate=1e-2, epsilon=None, noise_multiplier=1.0,
                       accountant="rdp", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       max_steps=max_steps, ddp_backend="gloo", dp_seed=3, trainable="all", save_strategy="steps",
                       save_steps=2, save_total_limit=None, ignore_data_skip=True, fsdp="full_shard",
                       fsdp_config={{"transformer_layer_cls_to_wrap": ["BertLayer"], "state_dict_type": "SHARDED_STATE_DICT"}})
        trainer = DPTrainer(model=make_model(), args=args, train_dataset=ds, data_collator=make_collator(tok),
                            processing_class=tok)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, dict(noises=list(noises), ledger_steps=trainer.ledger.steps,
                             resumed_ledger_steps=trainer.dp.lineage.resumed_ledger_steps,
                             stream_tag=trainer.ledger.meta.get("stream_tag"))

    results = {{}}
    _, results["U"] = run("u", 4)
    _, results["R2"] = run("r2", 6, resume=os.path.join(out, "u", "checkpoint-2"))
    r4, results["R4"] = run("r4", 6, resume=os.path.join(out, "u", "checkpoint-4"))
    r4.save_model(os.path.join(out, "checkpoint-final"))  # a release whose folder name starts with "checkpoint-"
    r4.save_model(os.path.join(out, "final"))
    torch.save(results, os.path.join(out, f"rank{{rank}}.pt"))
    """

pytestmark = DISTRIBUTED


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp_resume_release")
    launch(base, WORKER.format(), timeout=480)
    return base, list(rank_results(base))


def test_two_resumes_of_one_seeded_run_draw_different_fsdp_noise(runs):
    _, ranks = runs
    for res in ranks:
        r2, r4 = res["R2"], res["R4"]
        assert r2["resumed_ledger_steps"] == 2 and r4["resumed_ledger_steps"] == 4
        assert r2["ledger_steps"] == 4 + 4 and r4["ledger_steps"] == 4 + 2  # both first stepped at ledger step 4
        assert len(r2["noises"]) == 4 and len(r4["noises"]) == 2
        first2, first4 = r2["noises"][0], r4["noises"][0]
        assert first2.shape == first4.shape and first2.abs().max() > 0.1  # this rank's shards got noise
        assert not torch.allclose(first2, first4, atol=1e-3)  # old code: the same draw (up to rounding)
        assert r2["stream_tag"] is not None and r4["stream_tag"] is None  # R4 continues U's streams (a clean resume)
    assert ranks[0]["R2"]["stream_tag"] == ranks[1]["R2"]["stream_tag"]  # the ranks agree on the tag


def test_save_model_into_a_folder_named_checkpoint_writes_the_weights(runs):
    base, _ = runs
    from safetensors.torch import load_file

    release, plain = base / "checkpoint-final", base / "final"
    files = sorted(os.listdir(release))
    assert "model.safetensors" in files, files  # old code: config, card and privacy.json, no weights
    assert {"README.md", "privacy.json", "config.json"} <= set(files)
    assert not (release / "hf_dp_checkpoint.json").exists()  # a release, not a checkpoint
    a, b = load_file(str(release / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((release / "privacy.json").read_text())["epsilon"] == json.loads((plain / "privacy.json").read_text())["epsilon"]
