"""The one way to build a DP optimizer: an update rule from the registry, wrapped in the privatizer.

:func:`make_optimizer` is used by ``DPTrainer.create_optimizer`` (with HF's decay / no-decay parameter
groups), the audit, the benchmarks and the tests. :func:`rule_hyperparameters` maps the trainer's flags
(and ``--optim_args``) to the keyword arguments a rule's constructor takes.
"""

from __future__ import annotations

import inspect
from typing import Any

from .registry import get_entry


def make_optimizer(
    name: str,
    params,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    noise_seed: int | None = None,
    secure_mode: bool = False,
    ledger=None,
    max_epsilon: float | None = None,
    noise_mechanism: str = "independent",
    noise_bands: int = 1,
    **hyperparameters,
):
    """Build DP optimizer ``name``: its update rule wrapped in the privatizer.

    ``params``: parameters or parameter groups (dicts with ``params`` and per-group options such as
    ``weight_decay``). ``hyperparameters`` go to the update rule (lr, betas, eps, weight_decay, momentum,
    gamma, h1, h2, …); σ, C and B go to the privatizer, which hands the rule the noise scale it needs.
    ``noise_seed``, ``secure_mode``, ``ledger``, ``max_epsilon``, ``noise_mechanism`` and ``noise_bands``: see
    :class:`~hf_dp.privacy.privatizer.PrivateOptimizer`.
    """
    from hf_dp.privacy.privatizer import PrivateOptimizer  # privacy imports optim.base: not at module level

    rule = get_entry(name).rule_cls(params, **hyperparameters)
    return PrivateOptimizer(
        rule,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size,
        noise_seed=noise_seed,
        secure_mode=secure_mode,
        ledger=ledger,
        max_epsilon=max_epsilon,
        noise_mechanism=noise_mechanism,
        noise_bands=noise_bands,
    )


def rule_hyperparameters(name: str, *, lr: float, weight_decay: float, optim_args: str | None = None, **optional) -> dict:
    """Keyword arguments for rule ``name``'s constructor.

    ``lr`` and ``weight_decay``, then each of ``optional`` (betas, eps, gamma, h1, h2, …) that is not
    ``None``, then ``optim_args`` (``"key=value,key=value"``: numbers, true/false, or a name for a hyper-parameter
    that takes one, e.g. ``variant=adam_corr``; a key the rule does not take is refused); of these, only the ones the
    rule's constructor takes are returned.
    """
    accepted = inspect.signature(get_entry(name).rule_cls.__init__).parameters
    kw: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    kw.update({k: v for k, v in optional.items() if k in accepted and v is not None})
    if optim_args:
        for item in optim_args.replace(" ", "").split(","):
            if not item:
                continue
            key, _, value = item.partition("=")
            if key not in accepted or key == "params":
                hint = "; the authors' code is now variant=adam_corr" if key == "authors_code" else ""
                raise ValueError(f"--optim_args: {name} has no hyper-parameter {key!r}{hint}")
            flag = {"true": True, "false": False}.get(value.lower())  # e.g. fused=False
            if flag is not None:
                kw[key] = flag
            elif isinstance(accepted[key].default, str):  # a name (the rule checks it)
                kw[key] = value
            else:
                try:
                    kw[key] = float(value)
                except ValueError:
                    raise ValueError(f"--optim_args: {key}={value!r} is neither a number nor true/false") from None
    return {k: v for k, v in kw.items() if k in accepted}
